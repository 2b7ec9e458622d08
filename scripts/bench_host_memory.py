"""Host memory per parameter of a trainer, next to the design's count.

    python scripts/bench_host_memory.py                          # ~300M params, clipping on, fp32 grads
    python scripts/bench_host_memory.py --grad-dtype bfloat16    # the bf16 gradient store
    python scripts/bench_host_memory.py --no-clip --json out.json

Runs a Llama-shaped model on a StreamedEngine for a few steps on tiny batches, twice, each in a
fresh process: once with --small-layers layers and once with about --params million parameters.
Compute runs on CPU device 0 and the state lives on CPU device 1 (two XLA CPU devices in one
process), so the engine takes its accelerator path: the bus copy waits in device 0's pinned host
memory and every transfer is a real copy. Three figures per parameter:

- host arrays: the bytes of the live jax arrays in host memory (on the state device, or in pinned
  host memory), per param: exactly what the engine holds, nothing the allocator or the runtime
  adds. Sampled after each step (steady state, once the host updates are done) and through the
  step, for its peak: after each unit's work is dispatched (`engine.on_phase`; its last, "embed
  backward", comes right before the step's updates are queued: every unit's gradient then waits
  on the host for the global norm and the bus copies are released), and when the step returns. The live
  arrays of the compute device (activations, weights in flight, the fp32 gradient accumulator) are
  the device working set, reported apart.
- RSS, marginal: (RSS of the large run - RSS of the small run) / (their difference in params).
  Everything that does not grow with the parameter count cancels: the Python + JAX runtime, the
  compiled programs and XLA's compile-time memory, the device working set (its size follows the
  layer's, the same in both runs).
- RSS, raw: (RSS - RSS before the model was built) / params of the large run, as the process sees
  it, fixed costs included. VmRSS after the step; peak = VmHWM within a step (reset before it).
"""

import argparse
import json
import subprocess
import sys
import time


def model_config(hidden: int, layers: int):
    """The Llama-shaped model of both runs: `layers` layers of width `hidden`."""
    from megatrain_jax.model import ModelConfig
    return ModelConfig(vocab_size=257, hidden_size=hidden, intermediate_size=int(2.75 * hidden),
                       num_layers=layers, num_heads=hidden // 128, num_kv_heads=hidden // 128)


def child(args):
    from megatrain_jax import hostmem

    if args.mmap_threshold:
        hostmem.set_mmap_threshold(int(args.mmap_threshold * 2**20))
    import jax

    jax.config.update("jax_num_cpu_devices", 2)  # before the backend starts
    import jax.numpy as jnp
    import numpy as np

    from megatrain_jax.config import OptimizerConfig
    from megatrain_jax.engine import StreamedEngine
    from megatrain_jax.model import make_block, make_stages
    from megatrain_jax.recipes import build_optimizer

    compute, host = jax.devices("cpu")[:2]
    cfg = model_config(args.hidden, args.layers)
    jnp.zeros(1, device=compute).block_until_ready()  # the backend is up before the baseline
    base = hostmem.rss_bytes()

    def live_bytes():
        """(host, device) bytes of the live jax arrays."""
        out = [0, 0]
        for x in jax.live_arrays():
            if x.is_deleted():
                continue
            on_host = x.sharding.memory_kind in ("pinned_host", "unpinned_host") or \
                x.devices() == {host}
            out[0 if on_host else 1] += x.nbytes
        return out

    first, last = make_stages(cfg, 0)
    engine = StreamedEngine(first=first, last=last, make_block=lambda i: make_block(cfg, 0, i),
                            num_layers=cfg.num_layers,
                            optimizer=build_optimizer(OptimizerConfig(), 100),
                            max_grad_norm=None if args.no_clip else 1.0, compute_dtype=jnp.bfloat16,
                            grad_dtype=jnp.dtype(args.grad_dtype), compute_device=compute,
                            host_device=host)
    del first, last
    sizes = [sum(x.size for x in jax.tree.leaves(unit)) for unit in engine.unit_shapes()]
    n = sum(sizes)
    built = hostmem.rss_bytes()

    samples = []  # live (host, device) bytes within the current step
    engine.on_phase = lambda phase, layer=None: samples.append(live_bytes())

    def settled_live_bytes():
        """live_bytes() once it stops changing: the host thread drops an update's arguments (a
        gradient) just after that update's future completes, so right after `wait` they may still
        be alive for a moment."""
        last = live_bytes()
        for _ in range(100):
            time.sleep(0.005)
            now = live_bytes()
            if now == last:
                break
            last = now
        return last

    toks = np.random.default_rng(0).integers(0, cfg.vocab_size, size=(1, 1, args.seq + 1),
                                             dtype=np.int32)
    rows = []
    for step in range(1, args.steps + 1):
        samples.clear()
        hostmem.reset_peak()
        t0 = time.perf_counter()
        out = engine.train_step(toks[..., :-1], toks[..., 1:])
        samples.append(live_bytes())  # the backward is dispatched; the updates are submitted
        float(out["loss"])
        engine.wait()
        seconds = time.perf_counter() - t0
        steady = settled_live_bytes()
        rows.append({"step": step, "seconds": seconds, "rss": hostmem.rss_bytes(),
                     "peak_rss": hostmem.peak_rss_bytes(), "host_arrays": steady[0],
                     "peak_host_arrays": max(s[0] for s in samples + [steady]),
                     "peak_device_arrays": max(s[1] for s in samples + [steady])})
    engine.close()
    print(json.dumps({"params": n, "unit_params": sizes, "layers": cfg.num_layers,
                      "baseline_rss": base, "built_rss": built, "steps": rows}))


def run_child(args, layers: int) -> dict:
    cmd = [sys.executable, __file__, "--child", "--layers", str(layers), "--hidden", str(args.hidden),
           "--steps", str(args.steps), "--seq", str(args.seq), "--grad-dtype", args.grad_dtype,
           "--mmap-threshold", str(args.mmap_threshold)]
    if args.no_clip:
        cmd.append("--no-clip")
    proc = subprocess.run(cmd, capture_output=True, text=True)
    if proc.returncode:
        sys.exit(f"the {layers}-layer run failed:\n{proc.stderr[-3000:]}")
    return json.loads(proc.stdout.strip().splitlines()[-1])


def main():
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--params", type=float, default=300, help="large model size, millions")
    parser.add_argument("--small-layers", type=int, default=1, help="layers of the small run")
    parser.add_argument("--hidden", type=int, default=2048)
    parser.add_argument("--steps", type=int, default=3)
    parser.add_argument("--seq", type=int, default=32, help="tokens per step (one sequence)")
    parser.add_argument("--no-clip", action="store_true",
                        help="no global-norm clipping (the gradients wait for the norm either way)")
    parser.add_argument("--grad-dtype", default="float32", choices=("float32", "bfloat16"),
                        help="the engine's grad_dtype: gradients to and on the host")
    parser.add_argument("--mmap-threshold", type=float, default=0,
                        help="MiB: glibc serves blocks this large by mmap, returned on free "
                             "(hostmem.set_mmap_threshold; 0: glibc's default, adaptive)")
    parser.add_argument("--json", default="")
    parser.add_argument("--child", action="store_true", help=argparse.SUPPRESS)
    parser.add_argument("--layers", type=int, default=0, help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.child:
        return child(args)

    one = model_config(args.hidden, 1)
    layers = max(args.small_layers + 1, round(args.params * 1e6 / one.num_params(include_embeddings=False)))
    small, large = run_child(args, args.small_layers), run_child(args, layers)
    clip, g = not args.no_clip, 2 if args.grad_dtype == "bfloat16" else 4
    n, layer, dn = large["params"], large["unit_params"][1], large["params"] - small["params"]

    # The design's count: fp32 master + m + v (12) and the bf16 bus copy (2) at steady state. Peak:
    # every unit's gradient (g bytes) is held until the global norm is known (the update scales by
    # 1/sum(weight), clips, and skips a non-finite step: with or without clipping), while each
    # unit's bus copy is released after its last use in the step (12 + g). The engine's
    # accelerator path adds a reused bf16 staging buffer per unit structure (stages, one layer).
    staging = 2 * (large["unit_params"][0] + layer) / n
    design = {"steady": 12 + 2, "peak": 12 + g}

    def summary(run):
        rows = run["steps"]
        timed = rows[1:] or rows  # the first step compiles
        return {"rss": rows[-1]["rss"], "peak_rss": max(r["peak_rss"] for r in timed),
                "host_arrays": rows[-1]["host_arrays"],
                "peak_host_arrays": max(r["peak_host_arrays"] for r in timed),
                "peak_device_arrays": max(r["peak_device_arrays"] for r in timed)}
    s, b = summary(small), summary(large)
    per_param = {
        "host_arrays": b["host_arrays"] / n, "peak_host_arrays": b["peak_host_arrays"] / n,
        "rss_marginal": (b["rss"] - s["rss"]) / dn, "peak_rss_marginal": (b["peak_rss"] - s["peak_rss"]) / dn,
        "rss_raw": (b["rss"] - large["baseline_rss"]) / n,
        "peak_rss_raw": (b["peak_rss"] - large["baseline_rss"]) / n}

    import jax
    print(f"large: {n / 1e6:.1f}M params, {large['layers']} layers of {layer / 1e6:.1f}M; small: "
          f"{small['layers']} layer(s), {small['params'] / 1e6:.1f}M | AdamW fp32 master + m + v, bf16 "
          f"bus copy, {args.grad_dtype} grads, clipping {'on' if clip else 'off'} | compute CPU:0, "
          f"state CPU:1 | mmap threshold "
          f"{format(args.mmap_threshold, 'g') + ' MiB' if args.mmap_threshold else 'glibc default'} | "
          f"jax {jax.__version__}")
    print(f"runtime before the model: {large['baseline_rss'] / 2**20:.0f} MiB; device working set "
          f"at the peak: {b['peak_device_arrays'] / 2**20:.0f} MiB (live arrays on CPU:0)")
    print(f"{'bytes / param':34s} {'steady':>8s} {'peak':>8s}")
    print(f"{'host arrays (large run)':34s} {per_param['host_arrays']:8.2f} "
          f"{per_param['peak_host_arrays']:8.2f}")
    print(f"{'RSS, marginal (large - small)':34s} {per_param['rss_marginal']:8.2f} "
          f"{per_param['peak_rss_marginal']:8.2f}")
    print(f"{'RSS, raw (large run)':34s} {per_param['rss_raw']:8.2f} {per_param['peak_rss_raw']:8.2f}")
    print(f"{'design (+ staging ' + format(staging, '.2f') + ')':34s} {design['steady']:8.2f} "
          f"{design['peak']:8.2f}")
    print(f"step seconds (large run): {', '.join(format(r['seconds'], '.1f') for r in large['steps'])}")
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"clip": clip, "grad_dtype": args.grad_dtype,
                       "mmap_threshold_mib": args.mmap_threshold, "bytes_per_param": per_param,
                       "design": design, "staging_bytes_per_param": staging,
                       "peak_device_working_set_bytes": b["peak_device_arrays"],
                       "small": small, "large": large, "jax": jax.__version__}, f, indent=1)


if __name__ == "__main__":
    main()
