"""Host optimizer step vs the machine's copy bandwidth.

    python scripts/bench_optimizer.py                      # ~300M params, AdamW, 5 repetitions
    python scripts/bench_optimizer.py --params 100 --cores 1 --json out.json

Builds a StreamedEngine holding a Llama-shaped model of about --params million parameters (state on
the CPU, compute on the same CPU device, so the bus copy is a plain host buffer), then times the
engine's own host update path (`engine.host.submit` for every unit with the global norm and the
scale 1/sum(weight), then `wait`) with gradients already on the host and the bus copies released, as
a step leaves them. Effective bandwidth counts the bytes one update must touch: read param, m, v,
write param, m, v (24 B), read the gradient (4 B, 2 with --grad-dtype bfloat16) plus the
compute-dtype bus copy written in the same call. The copy bandwidth is numpy `copyto` between
existing buffers of the same sizes (read + write), single-threaded and split over all cores (once
when that is one core); the ratio uses the fastest. Last line: `optimizer_vs_copy_bandwidth: R`.
"""

import argparse
import json
import os
import sys
import time

parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
parser.add_argument("--params", type=float, default=300, help="model size, millions (default 300)")
parser.add_argument("--hidden", type=int, default=2048, help="hidden size (layer ~ 24.5 x hidden^2)")
parser.add_argument("--reps", type=int, default=5, help="timed repetitions (median reported)")
parser.add_argument("--cores", type=int, default=0, help="restrict to the first N cores (0: all)")
parser.add_argument("--clip", action="store_true",
                    help="global-norm clipping on (max_grad_norm 1.0; the norm given is below it, "
                         "so the clip's arithmetic runs and changes nothing)")
parser.add_argument("--accelerator-path", action="store_true",
                    help="state on a second CPU device, so the engine takes the path it takes with a "
                         "GPU: the update writes a reused staging buffer, copied to pinned host memory")
parser.add_argument("--grad-dtype", default="float32", choices=["float32", "bfloat16"],
                    help="the engine's gradient store (train.grad_dtype)")
parser.add_argument("--json", default="", help="also write the results here")
args = parser.parse_args()
if args.cores:  # before jax starts: XLA:CPU sizes its thread pool from the affinity mask
    os.sched_setaffinity(0, sorted(os.sched_getaffinity(0))[:args.cores])

import concurrent.futures  # noqa: E402
import resource  # noqa: E402

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402

if args.accelerator_path:
    jax.config.update("jax_num_cpu_devices", 2)
import numpy as np  # noqa: E402

from megatrain_jax.config import OptimizerConfig  # noqa: E402
from megatrain_jax.engine import StreamedEngine  # noqa: E402
from megatrain_jax.model import ModelConfig, make_block, make_stages  # noqa: E402
from megatrain_jax.train import build_optimizer  # noqa: E402

THREADS = len(os.sched_getaffinity(0))  # XLA:CPU's intra-op pool follows the affinity mask


def model_config(params_m: float, hidden: int) -> ModelConfig:
    one = ModelConfig(vocab_size=257, hidden_size=hidden, intermediate_size=int(2.75 * hidden),
                      num_layers=1, num_heads=hidden // 128, num_kv_heads=hidden // 128)
    layers = max(1, round(params_m * 1e6 / one.num_params(include_embeddings=False)))
    return ModelConfig(**{**one.__dict__, "num_layers": layers})


def make_copy(sizes, threads, pool):
    """numpy copyto between existing fp32 buffers of `sizes` elements, split over `threads`."""
    # One buffer pair per distinct size (the layers share one), written now: no page faults later.
    buffers = {n: (np.full(n, 1.0, np.float32), np.full(n, 0.0, np.float32)) for n in set(sizes)}

    def copy_all():
        for s, d in (buffers[n] for n in sizes):
            bounds = np.linspace(0, len(s), threads + 1).astype(int)
            parts = [(d[a:b], s[a:b]) for a, b in zip(bounds[:-1], bounds[1:])]
            list(pool.map(lambda part: np.copyto(*part), parts))  # copyto releases the GIL
    return copy_all


def timed(fn):
    faults = resource.getrusage(resource.RUSAGE_SELF).ru_minflt
    t0 = time.perf_counter()
    fn()
    return time.perf_counter() - t0, resource.getrusage(resource.RUSAGE_SELF).ru_minflt - faults


def main():
    cfg = model_config(args.params, args.hidden)
    compute, host = jax.devices("cpu")[:2] if args.accelerator_path else [jax.devices("cpu")[0]] * 2
    first, last = make_stages(cfg, 0)
    engine = StreamedEngine(first=first, last=last, make_block=lambda i: make_block(cfg, 0, i),
                            num_layers=cfg.num_layers, optimizer=build_optimizer(OptimizerConfig(), 1000),
                            max_grad_norm=1.0 if args.clip else None, compute_dtype=jnp.bfloat16,
                            compute_device=compute, host_device=host,
                            grad_dtype=jnp.dtype(args.grad_dtype))
    del first, last
    host_state = engine.host
    units = host_state.units
    sizes = [sum(x.size for x in jax.tree.leaves(u.params)) for u in units]
    n_params = sum(sizes)
    grad_dtype = host_state.grad_dtype
    fill = jax.jit(lambda p: jax.tree.map(lambda x: jnp.full(x.shape, 1e-3, grad_dtype), p))
    on_host = lambda x: jax.device_put(x, engine.host_sharding)
    # The global norm of the scaled gradient (below max_grad_norm: clipping changes nothing) and
    # the scale 1 / sum(weight), as host scalars, as the step computes them.
    norm, scale = on_host(jnp.float32(0.5)), on_host(jnp.float32(1.0))
    send = {}

    def send_grads():  # untimed: as the step leaves them, each unit's gradient in grad_dtype on
        # the host and its bus copy released; fresh each time, since the update may take a
        # gradient's buffer over (donation)
        for u in range(len(units)):
            send[u] = on_host(fill(units[u].params))
            host_state.release_bus(u)
        jax.block_until_ready(send)

    def update():  # the engine's own path: every unit's update on its host thread, then wait
        for u in range(len(units)):
            host_state.submit(u, send.pop(u), norm, scale)
        engine.wait()

    pool = concurrent.futures.ThreadPoolExecutor(THREADS)
    copies = {k: make_copy(sizes, k, pool) for k in sorted({1, THREADS})}  # one with --cores 1
    send_grads()
    update()  # compile
    for c in copies.values():
        c()
    # Interleaved, so a neighbour's load on this shared machine hits every run alike.
    runs = {"update": [], **{f"copy_{k}": [] for k in copies}}
    faults = []
    for _ in range(args.reps):
        send_grads()
        t, f = timed(update)
        runs["update"].append(t)
        faults.append(f)
        for k, copy in copies.items():
            runs[f"copy_{k}"].append(timed(copy)[0])
    pool.shutdown()
    engine.close()

    med = {k: float(np.median(v)) for k, v in runs.items()}
    # read param, grad, m, v and write param, m, v: 24 B of fp32 + the gradient + the bus copy
    bytes_per_param = 24 + grad_dtype.itemsize + host_state.compute_dtype.itemsize
    update_gb_s = bytes_per_param * n_params / med["update"] / 1e9
    copy_gb_s = {k: 8 * n_params / med[k] / 1e9 for k in runs if k.startswith("copy")}
    ratio = update_gb_s / max(copy_gb_s.values())
    print(f"model: {n_params / 1e6:.1f}M params, {len(units) - 1} layers of {sizes[1] / 1e6:.1f}M | "
          f"AdamW (optax), bf16 bus copy, {args.grad_dtype} gradients, "
          f"clipping {'on' if args.clip else 'off'}, "
          f"{'accelerator path (staging + pinned copy)' if args.accelerator_path else 'bus in place'} | "
          f"{THREADS} threads (XLA:CPU intra-op pool; 1 dispatch thread) | median of {args.reps}")
    print(f"{'measurement':40s} {'time ms':>9s} {'GB/s':>7s} {'Mparams/s':>10s} {'page faults':>12s}")
    print(f"{'host update (' + str(bytes_per_param) + ' B/param touched)':40s} "
          f"{med['update'] * 1e3:9.1f} {update_gb_s:7.2f} {n_params / med['update'] / 1e6:10.0f} "
          f"{int(np.median(faults)):12d}")
    for k, bw in copy_gb_s.items():
        name = f"numpy copy, {k.split('_')[1]} thread(s) (8 B/param)"
        print(f"{name:40s} {med[k] * 1e3:9.1f} {bw:7.2f}")
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"params": n_params, "units": len(units), "layer_params": sizes[1],
                       "bytes_per_param_touched": bytes_per_param, "seconds": runs,
                       "update_gb_s": update_gb_s, "mparams_per_s": n_params / med["update"] / 1e6,
                       "copy_gb_s": copy_gb_s, "update_page_faults": faults, "threads": THREADS,
                       "clip": args.clip, "accelerator_path": args.accelerator_path,
                       "grad_dtype": args.grad_dtype,
                       "optimizer_vs_copy_bandwidth": ratio,
                       "jax": jax.__version__}, f, indent=1)
    print(f"optimizer_vs_copy_bandwidth: {ratio:.3f}")


if __name__ == "__main__":
    sys.exit(main())
