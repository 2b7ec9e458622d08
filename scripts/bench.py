"""Training benchmark: the streamed engine against a fully resident step, printed as one table.

    PYTHONPATH=. python3 scripts/bench.py --config configs/bench_1b.yaml [--steps 5] [key=value ...]
    # a model bigger than the GPU: cap device memory to at most a quarter of the training state
    PYTHONPATH=. python3 scripts/bench.py --config configs/bench_4b.yaml --device-mem-gb 10 \
        --baselines none

Runs warm-up steps, then N timed steps of the streamed engine on synthetic tokens (uniform over
the vocabulary; the data pipeline is not what is measured), then the same model and optax chain as
baselines: (a) resident, a plain jitted whole-model step with every array on the device, and
(b) offload, the same step with params and optax state kept in the device's `pinned_host` memory
kind between steps and moved by XLA inside the one jit. Writes every figure to JSON.

FLOPs (useful work, per step): 6 * N * tokens, N = parameters excluding the input embedding (its
lookup is not a matmul; the output projection is counted), plus attention 12 * L * (heads *
head_dim) * seq per token: the full T x T score matrix, which is what XLA's attention computes
(it masks the causal half, it does not skip it). The causal-only count (half the attention term) is
reported beside it. The backward's recompute of each block's forward is not useful work and is not
counted. There are no padding tokens (sequences are packed). GB = 1e9 bytes.
"""

import argparse
import contextlib
import dataclasses
import datetime
import json
import os
import platform
import subprocess
import sys
import time

GB = 1e9


def parse_args(argv):
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--config", help="YAML config file (defaults apply without one)")
    p.add_argument("overrides", nargs="*", metavar="key=value")
    p.add_argument("--steps", type=int, default=3, help="timed steps")
    p.add_argument("--warmup", type=int, default=1,
                   help="untimed steps first (compilation; at least 1)")
    p.add_argument("--baselines", default="resident,offload",
                   help="comma list of resident, offload; or none")
    p.add_argument("--device-mem-gb", type=float, default=None,
                   help="cap the device memory the process may use (GPU only: preallocates "
                        "this much via XLA_PYTHON_CLIENT_MEM_FRACTION)")
    p.add_argument("--matmul", type=int, default=0,
                   help="square matmul size for the measured peak (0: 8192 on GPU, 512 on CPU)")
    p.add_argument("--json", default=None, help="output file (default runs/bench/<config>.json)")
    p.add_argument("--cpu-devices", type=int, default=None, metavar="2",
                   help="on CPU: two devices, device 1 computing and device 0 holding the state, so "
                        "the engine takes the accelerator's path (copies inside the calls, the "
                        "direct update, the first stage's rule) as the tests arrange it")
    p.add_argument("--profile-main", action="store_true",
                   help="profile the timed steps' dispatching thread (cProfile, which slows it): "
                        "its 25 costliest functions by own time in the table and the JSON")
    return p.parse_args(argv)


def cap_device_memory(gb: float):
    """Before JAX starts: preallocate `gb` of GPU 0, which the allocator then never grows past."""
    from megatrain_jax.config import ConfigError
    try:
        out = subprocess.run(["nvidia-smi", "--query-gpu=memory.total", "--format=csv,noheader,"
                              "nounits", "-i", "0"], capture_output=True, text=True, timeout=60)
        total = int(out.stdout.split()[0]) * 2 ** 20
    except (OSError, ValueError, IndexError, subprocess.TimeoutExpired):
        raise ConfigError("--device-mem-gb needs an NVIDIA GPU (nvidia-smi did not answer)") \
            from None
    if gb * GB >= total:
        raise ConfigError(f"--device-mem-gb {gb} is not below the GPU's {total / GB:.1f} GB")
    os.environ["XLA_PYTHON_CLIENT_PREALLOCATE"] = "true"
    os.environ["XLA_PYTHON_CLIENT_MEM_FRACTION"] = f"{gb * GB / total:.4f}"


def host_rss_gb() -> dict:
    """Current and peak resident set size of this process (None where /proc is missing)."""
    from megatrain_jax import hostmem
    try:
        return {"rss_gb": hostmem.rss_bytes() / GB, "peak_rss_gb": hostmem.peak_rss_bytes() / GB}
    except OSError:
        return {"rss_gb": None, "peak_rss_gb": None}


def main(argv=None) -> int:
    args = parse_args(argv)
    from megatrain_jax.cli import run_cli
    return run_cli(lambda: bench(args))


def bench(args):
    from megatrain_jax.config import ConfigError, to_dict
    from megatrain_jax.recipes import load_config  # model.from_hf read too
    if args.steps < 1 or args.warmup < 1:
        raise ConfigError("--steps and --warmup must be >= 1 (the warm-up steps compile: with "
                          "none, compile time would be timed)")
    baselines = [b for b in args.baselines.split(",") if b and b != "none"]
    unknown = set(baselines) - {"resident", "offload"}
    if unknown:
        raise ConfigError(f"--baselines: unknown baseline {sorted(unknown)[0]!r}")
    if args.cpu_devices not in (None, 2):
        raise ConfigError(f"--cpu-devices must be 2 (device 1 computes, device 0 holds the "
                          f"state), got {args.cpu_devices}")
    cfg = load_config(args.config, args.overrides)
    if args.device_mem_gb is not None:
        cap_device_memory(args.device_mem_gb)  # must precede the first use of the GPU

    import jax
    import numpy as np
    placed = {}
    if args.cpu_devices:  # before the CPU backend starts
        jax.config.update("jax_num_cpu_devices", args.cpu_devices)
        host, compute = jax.devices("cpu")[:2]
        placed = {"compute_device": compute, "host_device": host}
        if cfg.offload.copies == "auto":  # auto takes eager copies on a CPU device
            placed["copies"] = "jit"
    dev = placed.get("compute_device") or jax.devices()[0]
    on_gpu = dev.platform != "cpu"
    m = cfg.model
    M, B, T = cfg.data.micro_batches, cfg.data.batch_size, cfg.data.seq_len
    tokens = M * B * T
    # + the head; a mixture of experts counts the routed experts only (FLOPs, MFU)
    n_params = m.num_active_params(include_embeddings=False) + m.hidden_size * m.vocab_size
    attn = 12 * m.num_layers * m.num_heads * m.head_size * T  # per token, full T x T
    flops = {"matmul_per_step": 6 * n_params * tokens, "attention_per_step": attn * tokens,
             "per_step": (6 * n_params + attn) * tokens,
             "per_step_causal_only": (6 * n_params + attn / 2) * tokens}
    state_gb = m.num_params() * 12 / GB  # fp32 master + Adam m and v
    print(f"{dev.device_kind} ({dev.platform}) | jax {jax.__version__} | "
          f"{m.num_params() / 1e6:,.1f}M params ({n_params / 1e6:,.1f}M active in matmuls) | "
          f"{tokens:,} tokens/step ({M} x {B} x {T}) | training state {state_gb:.3g} GB")

    rng = np.random.default_rng(cfg.train.seed)
    toks = rng.integers(0, m.vocab_size, size=(args.warmup + args.steps, M, B, T + 1),
                        dtype=np.int32)
    batches = [(t[..., :-1], t[..., 1:]) for t in toks]

    streamed, engine, init = run_streamed(cfg, batches, args.warmup, dev, keep_init=bool(baselines),
                                          profile=args.profile_main, placed=placed)
    print(f"streamed: {tokens / streamed['step_s']:,.0f} tokens/s, {streamed['step_s']:.3f} s/step "
          f"(engine built in {streamed['build_s']:.0f} s; copies {streamed['copies']}, bus "
          f"{streamed['bus']}, host update {streamed['host_update']})", flush=True)
    limit = (dev.memory_stats() or {}).get("bytes_limit")
    if limit:
        streamed["device_mem_limit_gb"] = limit / GB
        streamed["device_mem_limit_vs_training_state"] = limit / GB / state_gb
    streamed.update(measure_resident_compute(jax, engine, batches[0], streamed["step_s"], on_gpu))
    graphdefs = (engine.stages_graphdef, engine.block_graphdef)
    engine.close()
    del engine
    # After the streamed run: peak_bytes_in_use is a process-wide peak that cannot be reset, so
    # the streamed figure above is the engine's own; the baselines' figures are peaks so far.
    matmul_n = args.matmul or (8192 if on_gpu else 512)
    peak = measure_matmul(jax, dev, cfg.train.compute_dtype, matmul_n)

    results = {}
    for name in baselines:
        results[name] = run_baseline(name, cfg, graphdefs, init, batches, args.warmup, dev, limit)
        print(f"{name}: " + (f"{tokens / results[name]['step_s']:,.0f} tokens/s" if "step_s" in
                             results[name] else results[name]["skipped"]), flush=True)

    record = {"kind": "train", "date": datetime.datetime.now().isoformat(timespec="seconds"),
              "command": " ".join([sys.executable, *sys.argv]), "jax": jax.__version__,
              "python": platform.python_version(), "device_kind": dev.device_kind,
              "platform": dev.platform, "config": to_dict(cfg), "config_file": args.config,
              "env": {k: v for k, v in os.environ.items() if k.startswith("XLA")},
              "steps": args.steps, "warmup": args.warmup, "cpu_devices": args.cpu_devices,
              "tokens_per_step": tokens,
              "params": m.num_params(), "matmul_params": n_params, "flops": flops,
              "training_state_gb": state_gb, "matmul_peak": peak, "streamed": streamed,
              "baselines": results}
    add_derived(record)
    print_table(record)
    path = args.json or os.path.join("runs", "bench", os.path.splitext(
        os.path.basename(args.config or "defaults"))[0] + ".json")
    os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
    with open(path, "w") as f:
        json.dump(record, f, indent=1)
    print(f"wrote {path}")


# ----------------------------------------------------------------------------- measurements
def best(fn, reps) -> float:
    """Seconds of fn() to completion: run once untimed (compilation), then the min of reps runs."""
    import jax
    jax.block_until_ready(fn())
    times = []
    for _ in range(reps):
        t0 = time.perf_counter()
        jax.block_until_ready(fn())
        times.append(time.perf_counter() - t0)
    return min(times)


def measure_matmul(jax, dev, dtype, n, iters=10) -> dict:
    """The device's dense matmul rate in the compute dtype, measured now (the MFU denominator)."""
    import jax.numpy as jnp

    from megatrain_jax.machines import peak_bf16_tflops  # the one table of datasheet peaks
    a = jax.device_put(jnp.full((n, n), 1e-3, dtype), dev)
    chain = jax.jit(lambda a: jax.lax.fori_loop(0, iters, lambda i, c: c @ a, a))
    seconds = best(lambda: chain(a), 5)
    sheet = peak_bf16_tflops(dev.device_kind)
    return {"n": n, "dtype": str(dtype), "tflops": 2 * n ** 3 * iters / seconds / 1e12,
            "datasheet_bf16_tflops": sheet}


def run_streamed(cfg, batches, warmup, dev, keep_init, profile=False, placed=None):
    import jax
    import numpy as np
    from megatrain_jax.recipes import build_engine
    t0 = time.perf_counter()
    engine = build_engine(cfg, **(placed or {}))
    # the forms the engine chose ("auto" in the config resolves by machine)
    out = {"build_s": time.perf_counter() - t0, "copies": engine.copies, "bus": engine.bus,
           "host_update": engine.host_update}
    # The baselines start from the same weights and see the same batches, so their losses must
    # track the engine's: a check that they do the same work. (A copy: updates donate the params.)
    init = jax.tree.map(np.array, engine.params()) if keep_init else None
    losses = [float(engine.train_step(inputs, targets)["loss"])
              for inputs, targets in batches[:warmup]]
    engine.wait()
    names = ("bytes_h2d", "bytes_d2h", "host_update_s", "host_wait_s", "host_compute_s",
             "device_wait_s", "first_stage_wait_s")
    counters = lambda: [getattr(engine.counters, k) for k in names]
    before, dispatched = counters(), dataclasses.replace(engine.counters)
    in_use_before = dev.memory_stats()  # None on a CPU
    from megatrain_jax.profiling import MainThreadProfile
    profiler = MainThreadProfile() if profile else None
    step_times, t0, previous = [], time.perf_counter(), None
    for inputs, targets in batches[warmup:]:
        ts = time.perf_counter()
        with profiler.steps() if profiler else contextlib.nullcontext():
            result = engine.train_step(inputs, targets)
            if previous is not None:  # the step before's loss, read while this one runs
                losses.append(float(previous["loss"]))
        previous = result
        step_times.append(time.perf_counter() - ts)
    losses.append(float(previous["loss"]))
    n = len(batches) - warmup
    dispatched = dispatch_counts(dispatched, engine.counters, n)  # the steps' own, not wait()'s
    engine.wait()  # the last step's host updates belong to the timed steps (exposed: counted)
    total = time.perf_counter() - t0
    h2d, d2h, upd, wait, compute, device_wait, first_stage_wait = (
        after - b for after, b in zip(counters(), before))
    dispatched["main_thread_s"] = {"device_wait": device_wait / n, "update_wait": wait / n,
                                   "first_stage_wait": first_stage_wait / n,
                                   "other": (total - device_wait - wait - first_stage_wait) / n}
    out.update({"total_s": total, "step_s": total / n, "step_times_s": step_times, "losses": losses,
                "h2d_gb_per_step": h2d / n / GB, "d2h_gb_per_step": d2h / n / GB,
                "h2d_gb_per_s": h2d / total / GB, "d2h_gb_per_s": d2h / total / GB,
                "host_update_s_per_step": upd / n, "host_exposed_s_per_step": wait / n,
                "host_hidden_s_per_step": (upd - wait) / n,
                "host_compute_s_per_step": compute / n,
                # the main thread: waiting for the device at retires, for host updates, the rest
                # dispatching (and the step's own syncs)
                "device_wait_s_per_step": device_wait / n,
                "main_thread_other_s_per_step": dispatched["main_thread_s"]["other"],
                "dispatch": dispatched})
    if profiler:
        out["main_thread_profile"] = profiler.costliest(n)
    out.update(device_memory(dev))
    out.update(device_left_by_steps(in_use_before, dev.memory_stats()))
    out.update(host_rss_gb())
    return out, engine, init


def dispatch_counts(before, after, n: int) -> dict:
    """The dispatching thread's work per step between two snapshots of engine.counters (Counters)
    n steps apart: jitted calls, their argument leaves, eager device_puts (and their leaves),
    arrays deleted, syncs (in all, and by kind)."""
    per = lambda name: (getattr(after, name) - getattr(before, name)) / n
    kinds = {k: (v - before.syncs.get(k, 0)) / n for k, v in after.syncs.items()}
    return {"calls_per_step": per("calls"), "arg_leaves_per_step": per("arg_leaves"),
            "device_puts_per_step": per("device_puts"),
            "device_put_leaves_per_step": per("put_leaves"), "deleted_per_step": per("deleted"),
            "syncs_per_step": sum(kinds.values()), "syncs_by_kind_per_step": kinds}


def device_left_by_steps(before, after) -> dict:
    """Device bytes in use after the timed steps (their host updates done) less before them. A
    step deletes every array it puts on the device, and bus copies wait in pinned host memory:
    anything left (e.g. bus copies an XLA put in device memory) is a copy the plan never counts."""
    if not before or not after or "bytes_in_use" not in after:
        return {"device_left_by_steps_gb": None}
    return {"device_in_use_before_gb": before["bytes_in_use"] / GB,
            "device_in_use_after_gb": after["bytes_in_use"] / GB,
            "device_left_by_steps_gb": (after["bytes_in_use"] - before["bytes_in_use"]) / GB}


def device_memory(dev, key="device_peak_gb") -> dict:
    """peak_bytes_in_use: the process's peak so far (it cannot be reset), under `key`."""
    stats = dev.memory_stats()
    if not stats or "peak_bytes_in_use" not in stats:
        return {key: None, "device_peak_note": f"{dev.platform}: no memory_stats()"}
    return {key: stats["peak_bytes_in_use"] / GB}


def measure_resident_compute(jax, engine, batch, step_s, on_gpu) -> dict:
    """Device time of one step's kernels with no transfers: the engine's own jitted device
    functions (`engine.device_functions`) run back to back on weights already on the device (one
    layer timed, times L, plus the stages). Divided by the streamed step time it estimates the
    fraction of the step the device was busy. (The same idea as a profiler trace's busy time,
    without parsing a trace.)"""
    dev, L = engine.compute_device, engine.num_layers
    cdt = engine.compute_dtype
    cast = lambda t: jax.device_put(jax.tree.map(lambda p: p.astype(cdt), t), dev)
    inputs, targets = (jax.device_put(x, dev) for x in batch)  # the micro-batches stacked
    f = engine.device_functions(inputs[0], targets[0])
    params = engine.params()
    stage_leaves = jax.tree.leaves(cast(params["stages"]))  # each part as the step fetches it
    w_first, w_last = (engine.parts.take(part, stage_leaves) for part in ("first", "last"))
    w_layer = jax.device_put(f.packing.packed(  # as the engine fetches it (engine/packing.py)
        jax.tree.map(lambda p: p.astype(cdt), params["layers"][0]), engine.host_sharding), dev)
    layer_0 = (w_layer, jax.device_put(engine.block_constants[0], dev))
    xs = jax.block_until_ready(f.embed(w_first, inputs))

    def layer():  # forward of all micro-batches, then backward (recompute + vjp), as in a step
        (ys, _), _, _ = f.layer_fwd(None, None, layer_0, xs, None)
        (dxs, _, sq), _, _ = f.layer_bwd(None, None, layer_0, xs, None, ys, None)
        return dxs, sq

    def stages():  # embedding forward, loss head (value and grad), embedding backward
        hs = f.embed(w_first, inputs)
        _, _, _, dxs, last = f.head(w_last, hs, targets)
        first, _, _ = f.embed_bwd(None, None, w_first, inputs, dxs)
        return last, first

    compute = L * best(layer, 3) + best(stages, 3)
    out = {"resident_compute_s_per_step": compute}
    if on_gpu:
        out["device_busy"] = min(1.0, compute / step_s)
        out["device_busy_method"] = ("estimate: resident compute time of the engine's jitted "
                                     "device functions (no transfers) / streamed step time")
    else:
        out["device_busy"] = None
        out["device_busy_method"] = ("n/a on CPU: the 'device' and the host optimizer thread share "
                                     "the same cores, so device busy time is not separable")
    return out


# ----------------------------------------------------------------------------- baselines
def run_baseline(name, cfg, graphdefs, params, batches, warmup, dev, limit) -> dict:
    """(a) resident: every array on the device, plain jitted step. (b) offload: params and optax
    state in the device's pinned_host memory kind between steps, moved by XLA inside the jit.
    Same model modules, optax chain, compute dtype, micro-batching and remat (each block saves only
    its input, as the streamed engine does), so the tokens and FLOPs per step are identical."""
    n = cfg.model.num_params()  # the same count as the leaves of `params` (tied or not)
    act = cfg.model.num_layers * cfg.data.batch_size * cfg.data.seq_len * cfg.model.hidden_size * 2
    need = n * 20 + act  # fp32 params, m, v, grad accumulator (16 B) + compute-dtype copy, grads
    if limit and need > limit:
        return {"skipped": f"does not fit: needs about {need / GB:.1f} GB on the device "
                           f"(fp32 params + Adam + grads + activations), the device has "
                           f"{limit / GB:.1f} GB"}
    kinds = {mem.kind for mem in dev.addressable_memories()}
    if name == "offload" and "pinned_host" not in kinds:
        return {"skipped": f"{dev.platform} device has no pinned_host memory kind"}
    try:
        return time_baseline(name, cfg, graphdefs, params, batches, warmup, dev)
    except Exception as e:  # an out-of-memory baseline is a result; anything else is a bug
        msg = str(e)
        if "RESOURCE_EXHAUSTED" not in msg and "Out of memory" not in msg:
            raise
        return {"skipped": f"out of device memory: {msg.splitlines()[0][:200]}"}


def time_baseline(name, cfg, graphdefs, params, batches, warmup, dev) -> dict:
    import jax
    import jax.numpy as jnp
    import optax
    from flax import nnx
    from megatrain_jax.recipes import build_optimizer

    stages_def, block_def = graphdefs
    cdt = jnp.dtype(cfg.train.compute_dtype)
    tx = build_optimizer(cfg.optimizer, cfg.train.steps)
    if cfg.optimizer.max_grad_norm:
        tx = optax.chain(optax.clip_by_global_norm(cfg.optimizer.max_grad_norm), tx)
    on_dev = jax.sharding.SingleDeviceSharding(dev)
    home = (jax.sharding.SingleDeviceSharding(dev, memory_kind="pinned_host")
            if name == "offload" else on_dev)
    # Remat: each block keeps only its input for the backward, like the streamed engine. The
    # layers are scanned over stacked weights so the step compiles one block, not L of them.
    block = jax.checkpoint(lambda w, x: nnx.merge(block_def, w)(x))

    def micro_loss(w, inputs, targets):  # w: {"stages": tree, "layers": tree stacked over L}
        first, last = nnx.merge(stages_def, w["stages"])
        x, _ = jax.lax.scan(lambda x, p: (block(p, x), None), first(inputs), w["layers"])
        loss_sum, count = last(x, targets)  # summed cross-entropy, counted tokens
        return loss_sum.astype(jnp.float32), count.astype(jnp.float32)

    def step(params, opt_state, inputs, targets):  # inputs, targets: (M, B, T)
        if name == "offload":
            params, opt_state = jax.device_put((params, opt_state), on_dev)
        w = jax.tree.map(lambda p: p.astype(cdt), params)
        w = {"stages": w["stages"], "layers": jax.tree.map(lambda *xs: jnp.stack(xs), *w["layers"])}

        def accumulate(carry, batch):  # as the engine: sums over micro-batches, then the mean
            (loss_sum, count), grads = jax.value_and_grad(micro_loss, has_aux=True)(w, *batch)
            return (carry[0] + loss_sum, carry[1] + count,
                    jax.tree.map(lambda a, g: a + g.astype(jnp.float32), carry[2], grads)), None

        zeros = jax.tree.map(lambda p: jnp.zeros(p.shape, jnp.float32), w)
        (loss, count, grads), _ = jax.lax.scan(accumulate, (jnp.float32(0), jnp.float32(0), zeros),
                                               (inputs, targets))
        grads = jax.tree.map(lambda g: g / count, grads)
        grads = {"stages": grads["stages"], "layers": [  # back to the optimizer's per-layer tree
            jax.tree.map(lambda g: g[i], grads["layers"]) for i in range(len(params["layers"]))]}
        updates, opt_state = tx.update(grads, opt_state, params)
        params = optax.apply_updates(params, updates)
        if name == "offload":
            params, opt_state = jax.device_put((params, opt_state), home)
        return params, opt_state, loss / count

    params = jax.device_put(params, on_dev, may_alias=False)  # the step donates it: a copy
    opt_state = jax.jit(tx.init)(params)
    params, opt_state = jax.device_put((params, opt_state), home)
    jitted = jax.jit(step, donate_argnums=(0, 1), out_shardings=(home, home, on_dev))
    losses = []
    for inputs, targets in batches[:warmup]:
        params, opt_state, loss = jitted(params, opt_state, inputs, targets)
        losses.append(float(loss))
    step_times, t0 = [], time.perf_counter()
    for inputs, targets in batches[warmup:]:
        ts = time.perf_counter()
        params, opt_state, loss = jitted(params, opt_state, inputs, targets)
        losses.append(float(loss))
        step_times.append(time.perf_counter() - ts)
    jax.block_until_ready((params, opt_state))  # the last step's outputs belong to the timed steps
    total = time.perf_counter() - t0
    out = {"step_s": total / len(step_times), "step_times_s": step_times, "losses": losses}
    # Not this baseline's own peak: the process's so far (streamed run and matmul included).
    out.update(device_memory(dev, "process_device_peak_so_far_gb"))
    return out


# ----------------------------------------------------------------------------- report
def add_derived(r):
    tokens, flops, peak = r["tokens_per_step"], r["flops"], r["matmul_peak"]
    for run in [r["streamed"], *r["baselines"].values()]:
        if "step_s" not in run:
            continue
        run["tokens_per_s"] = tokens / run["step_s"]
        run["model_tflops"] = flops["per_step"] / run["step_s"] / 1e12
        run["mfu_vs_measured"] = run["model_tflops"] / peak["tflops"]
        run["mfu_causal_only_vs_measured"] = (flops["per_step_causal_only"] / run["step_s"]
                                              / 1e12 / peak["tflops"])
        sheet = peak["datasheet_bf16_tflops"]
        run["mfu_vs_datasheet"] = (run["model_tflops"] / sheet
                                   if sheet and r["config"]["train"]["compute_dtype"] == "bfloat16"
                                   else None)
    for name, run in r["baselines"].items():
        if "tokens_per_s" in run:
            ratio = r["streamed"]["tokens_per_s"] / run["tokens_per_s"]
            r["streamed"][f"throughput_vs_{name}"] = ratio
            ref = r["streamed"]["losses"]
            run["loss_max_rel_diff_vs_streamed"] = max(
                abs(a - b) / abs(b) for a, b in zip(run["losses"], ref, strict=True))


def print_table(r):
    s, peak = r["streamed"], r["matmul_peak"]
    d = s.get("dispatch", {})
    main = d.get("main_thread_s", {})
    f = lambda v, spec=".2f": "n/a" if v is None else format(v, spec)
    rows = [
        ("tokens/s", f(s["tokens_per_s"], ",.0f"), f"{r['tokens_per_step']:,} tokens/step, "
         f"{s['step_s'] * 1e3:.0f} ms/step over {r['steps']} steps"),
        ("model TFLOP/s", f(s["model_tflops"], ".3g"),
         "6*N*tokens + full-T^2 attention; no recompute"),
        ("MFU vs measured matmul", f(s["mfu_vs_measured"], ".1%"),
         f"{peak['n']}^3 {peak['dtype']} matmul: {peak['tflops']:.3g} TFLOP/s this run"),
        ("MFU vs measured (causal-only)", f(s["mfu_causal_only_vs_measured"], ".1%"),
         "attention counted as half (the causal part)"),
        ("MFU vs datasheet", f(s["mfu_vs_datasheet"], ".1%"),
         f"bf16 peak {peak['datasheet_bf16_tflops']} TFLOP/s" if s["mfu_vs_datasheet"] is not None
         else "no datasheet peak for this device/dtype"),
        ("H2D GB/s (achieved)", f(s["h2d_gb_per_s"], ".3g"), f"{s['h2d_gb_per_step']:.3g} GB/step"),
        ("D2H GB/s (achieved)", f(s["d2h_gb_per_s"], ".3g"), f"{s['d2h_gb_per_step']:.3g} GB/step"),
        ("device busy", f(s["device_busy"], ".1%"), s["device_busy_method"]),
        ("host update s/step", f(s["host_update_s_per_step"], ".3f"),
         f"the host thread's, {s['host_update']}: from taking a unit to its bus copy ready"),
        ("  compute", f(s.get("host_compute_s_per_step"), ".3f"),
         "of which the update's own work (the rest waited for gradients and the norm)"),
        ("  hidden", f(s["host_hidden_s_per_step"], ".3f"), "overlapped with device work"),
        ("  exposed", f(s["host_exposed_s_per_step"], ".3f"), "the step waited for it"),
        ("main thread: device waits s", f(s.get("device_wait_s_per_step"), ".3f"),
         f"per step at the layers' retires; {f(main.get('first_stage_wait'), '.3f')} s for the "
         f"first stage's host backward; {f(main.get('other'), '.3f')} s waiting for neither "
         f"nor for updates (dispatching, the step's other syncs)"),
        ("main thread: jitted calls", f(d.get("calls_per_step"), ",.0f"),
         f"per step, {f(d.get('arg_leaves_per_step'), ',.0f')} argument leaves; eager "
         f"device_puts {f(d.get('device_puts_per_step'), ',.0f')} "
         f"({f(d.get('device_put_leaves_per_step'), ',.0f')} leaves); arrays deleted "
         f"{f(d.get('deleted_per_step'), ',.0f')}"),
        ("main thread: syncs", f(d.get("syncs_per_step"), ",.0f"),
         "per step: " + (", ".join(f"{k} {v:,.0f}" for k, v in sorted(
             d.get("syncs_by_kind_per_step", {}).items())) or "none")),
        ("device peak GB", f(s["device_peak_gb"]),
         s.get("device_peak_note", "peak_bytes_in_use (the streamed run comes first)")
         + (f"; cap {s['device_mem_limit_gb']:.1f} GB = "
            f"{s['device_mem_limit_vs_training_state']:.0%}"
            f" of the {r['training_state_gb']:.1f} GB training state"
            if s.get("device_mem_limit_gb") else "")),
        ("device left by steps GB", f(s.get("device_left_by_steps_gb")),
         "memory_stats() bytes_in_use after the timed steps less before: 0 unless a copy stays"),
        ("host RSS GB", f(s["rss_gb"]), f"peak {f(s['peak_rss_gb'])} GB (VmHWM)"),
    ]
    for name, b in r["baselines"].items():
        if "skipped" in b:
            rows.append((f"vs {name}", "n/a", f"skipped: {b['skipped']}"))
        else:
            rows.append((f"vs {name}", f(s[f"throughput_vs_{name}"], ".2f") + "x",
                         f"{name}: {b['tokens_per_s']:,.0f} tokens/s, MFU "
                         f"{b['mfu_vs_measured']:.1%}, process device peak so far "
                         f"{f(b['process_device_peak_so_far_gb'])} GB, "
                         f"losses within {b['loss_max_rel_diff_vs_streamed']:.1e} of streamed"))
    print(f"\nstreamed engine, {r['device_kind']} ({r['platform']}), losses "
          + " ".join(f"{x:.4f}" for x in s["losses"]))
    for name, value, note in rows:
        print(f"  {name:<30} {value:>10}   {note}")
    if s.get("main_thread_profile"):
        from megatrain_jax.profiling import format_rows
        print("\nthe dispatching thread, per timed step (cProfile; own time, cumulative, calls):")
        print("\n".join(format_rows(s["main_thread_profile"])))


if __name__ == "__main__":
    sys.exit(main())
