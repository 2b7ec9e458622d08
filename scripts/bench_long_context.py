"""Long-context benchmark: a few training steps of a small model at a long sequence, with the plan.

    PYTHONPATH=. python3 scripts/bench_long_context.py                  # 32768 tokens, vocab 65536
    PYTHONPATH=. python3 scripts/bench_long_context.py --dense-estimate --json out.json
    PYTHONPATH=. python3 scripts/bench_long_context.py --seq-len 4096 --vocab 8192 --steps 3
    PYTHONPATH=. python3 scripts/bench_long_context.py --config configs/llama3_8b.yaml \
        --seq-len 131072 --compute-dtype bfloat16 --attention auto model.num_layers=4

Builds the engine through the library (`recipes.build_engine`) for a small Llama-shaped model (by
default hidden 64, 2 layers, vocab 65536) at one long sequence (default 32768 tokens, batch 1) with
the long-context execution: fp32 compute, blockwise attention, the block's MLP in tiles, the
cross-entropy in chunks of tokens and of the vocabulary, and the saved activations offloaded to
host memory. Trains `--steps` steps on synthetic tokens (uniform over the vocabulary) and reports
the peak RSS (getrusage ru_maxrss) before the engine, once it is built and after the steps, the
time of each step (the first compiles), tokens/s, the losses (about ln(vocab) at the start), and
the plan's prediction (megatrain_jax.plan) for the same config on this machine, the attention
that runs (the plan's line: which, per query tile or over the whole sequence) and the step-time
model's step (megatrain_jax.step_time, with the GPU's peak and bus; on a CPU an H100's). On a GPU
it also reports the device's peak bytes in use (memory_stats) and the model TFLOP/s (6 FLOPs per
matmul parameter and token, plus causal attention, 12 * N * H per visible key, token and layer;
recompute not counted). `--config` takes the model (and anything else) from a YAML config
instead of the small default model; the flags for the sequence and the execution still apply.
The device peak does not depend on the number of layers, so a real model's shape with a few
layers measures it with little host memory.

--max-rss-gb asserts the peak RSS after the steps (exit 1 above it).

--dense-estimate also compiles, without running, the block backward and the loss head of the dense
path the engine took before the long-context work (attention=xla, no MLP tiles, the whole sequence
and vocabulary in one loss chunk) and prints XLA's memory analysis of both paths: what one step
would have needed without it (the T x T scores, the T x V logits). GB = 1e9 bytes.
"""

import argparse
import contextlib
import json
import math
import os
import platform
import resource
import sys
import time

GB = 1e9


def parse_args(argv):
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--config", default=None,
                   help="YAML config for the model (then --vocab, --layers, --hidden, "
                        "--intermediate, --heads and --kv-heads are ignored)")
    p.add_argument("--seq-len", type=int, default=32768)
    p.add_argument("--vocab", type=int, default=65536)
    p.add_argument("--layers", type=int, default=2)
    p.add_argument("--hidden", type=int, default=64)
    p.add_argument("--intermediate", type=int, default=0, help="MLP width (0: 2.75 x hidden)")
    p.add_argument("--heads", type=int, default=4)
    p.add_argument("--kv-heads", type=int, default=2)
    p.add_argument("--batch", type=int, default=1)
    p.add_argument("--steps", type=int, default=2, help="training steps (0: plan and estimate only)")
    p.add_argument("--compute-dtype", default="float32", choices=("float32", "bfloat16"))
    p.add_argument("--attention", default="blockwise", help="train.attention")
    p.add_argument("--attention-block", type=int, default=512)
    p.add_argument("--tile-size", type=int, default=8192)
    p.add_argument("--loss-chunk", type=int, default=2048)
    p.add_argument("--loss-vocab-chunk", type=int, default=8192)
    p.add_argument("--no-offload", action="store_true", help="keep saved activations on the device")
    p.add_argument("--dense-estimate", action="store_true",
                   help="compile (not run) the dense path's block backward and loss head and print "
                        "their memory analysis next to the long-context path's")
    p.add_argument("--profile-main", action="store_true",
                   help="profile the steps after the first on the dispatching thread (cProfile, "
                        "which slows it): its 25 costliest functions in the table and the JSON")
    p.add_argument("--max-rss-gb", type=float, default=None,
                   help="fail (exit 1) if the peak RSS after the steps exceeds this many GB")
    p.add_argument("--json", default=None, help="also write the results here")
    p.add_argument("overrides", nargs="*", metavar="key=value", help="further config overrides")
    return p.parse_args(argv)


def maxrss_bytes() -> int:
    """Peak resident set size of this process so far (ru_maxrss: KiB on Linux, bytes on macOS)."""
    peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    return peak if sys.platform == "darwin" else peak * 1024


def make_config(args, dense: bool = False):
    from megatrain_jax.recipes import load_config  # model.from_hf read too
    d = args.hidden
    execution = (["train.attention=xla", "train.tile_size=0", f"train.loss_chunk={args.seq_len}",
                  "train.loss_vocab_chunk=0", "train.offload_activations=false"] if dense else
                 [f"train.attention={args.attention}", f"train.tile_size={args.tile_size}",
                  f"train.loss_chunk={args.loss_chunk}",
                  f"train.loss_vocab_chunk={args.loss_vocab_chunk}",
                  f"train.offload_activations={'false' if args.no_offload else 'true'}"])
    model = [] if args.config else [
        f"model.vocab_size={args.vocab}", f"model.hidden_size={d}",
        f"model.intermediate_size={args.intermediate or int(2.75 * d)}",
        f"model.num_layers={args.layers}", f"model.num_heads={args.heads}",
        f"model.num_kv_heads={args.kv_heads}"]
    return load_config(args.config, [
        *model, f"data.seq_len={args.seq_len}",
        f"data.batch_size={args.batch}", "data.micro_batches=1", f"train.steps={max(args.steps, 1)}",
        f"train.compute_dtype={args.compute_dtype}", f"train.attention_block={args.attention_block}",
        "optimizer.warmup_steps=0", *execution, *args.overrides])


def main(argv=None) -> int:
    args = parse_args(argv)
    from megatrain_jax.cli import run_cli
    return run_cli(lambda: bench(args))


def bench(args):
    from megatrain_jax.config import ConfigError
    if args.steps < 0:
        raise ConfigError(f"--steps must be >= 0, got {args.steps}")
    if args.max_rss_gb is not None and args.max_rss_gb <= 0:
        raise ConfigError(f"--max-rss-gb must be > 0, got {args.max_rss_gb:g}")
    cfg = make_config(args)  # validated before anything is built

    import jax
    import numpy as np

    from megatrain_jax import plan as plan_lib
    from megatrain_jax.machines import machine_from_device
    from megatrain_jax.profiling import MainThreadProfile
    from megatrain_jax.recipes import build_engine

    rss = {"start": maxrss_bytes()}
    dev = jax.devices()[0]
    m, T, B = cfg.model, cfg.data.seq_len, cfg.data.batch_size
    tokens = B * T
    run_plan = plan_lib.plan(cfg, machine_from_device(dev))
    print(f"{dev.device_kind} ({dev.platform}) | jax {jax.__version__} | {m.num_params() / 1e6:,.2f}M "
          f"params: hidden {m.hidden_size}, {m.num_layers} layers, vocab {m.vocab_size} | "
          f"{tokens:,} tokens/step ({B} x {T}) | {cfg.train.compute_dtype}, train.attention "
          f"{cfg.train.attention}, tile {cfg.train.tile_size}, "
          f"loss chunk {cfg.train.loss_chunk} x vocab {cfg.train.loss_vocab_chunk or 'all'}, offload "
          f"{cfg.train.offload_activations}", flush=True)
    print(run_plan.summary(), flush=True)
    predicted = step_time_prediction(cfg, machine_from_device(dev), run_plan)

    rng = np.random.default_rng(cfg.train.seed)
    toks = rng.integers(0, m.vocab_size, size=(max(args.steps, 1), 1, B, T + 1), dtype=np.int32)
    rss["before_engine"] = maxrss_bytes()
    t0 = time.perf_counter()
    engine = build_engine(cfg, offload_activations=cfg.train.offload_activations is True,
                          execution=run_plan.execution)
    build_s = time.perf_counter() - t0
    rss["after_engine"] = maxrss_bytes()
    losses, grad_norms, step_times, compiles = [], [], [], []
    profiler = MainThreadProfile() if args.profile_main else None

    def measured() -> dict:
        stats = dev.memory_stats() or {}
        counters = engine.counters
        run = {"build_s": build_s, "step_times_s": step_times, "losses": losses,
               "grad_norms": grad_norms, "compiles": compiles, "bytes_h2d": counters.bytes_h2d,
               "bytes_d2h": counters.bytes_d2h, "host_update_s": counters.host_update_s,
               "host_wait_s": counters.host_wait_s,
               "device_peak_bytes": stats.get("peak_bytes_in_use"),
               "device_bytes_limit": stats.get("bytes_limit")}
        if profiler and step_times[1:]:
            run["main_thread_profile"] = profiler.costliest(len(step_times) - 1)
        timed = step_times[1:] or step_times  # the first step compiles
        if timed:
            run["step_s"] = sum(timed) / len(timed)
            run["tokens_per_s"] = tokens / run["step_s"]
            run["model_tflops"] = model_flops(cfg) * tokens / run["step_s"] / 1e12
            run["step_s_measured_over"] = ("steps after the first" if step_times[1:]
                                           else "first step")
        return run

    for t in toks[:args.steps]:
        # Each step timed to the end of its host updates (not overlapped with the next step's
        # forward): the first step's include compiling the update, which the second would wait for.
        profiled = profiler.steps() if profiler and step_times else contextlib.nullcontext()
        with count_compiles() as compiled, profiled:
            ts = time.perf_counter()
            out = engine.train_step(t[..., :-1], t[..., 1:])
            losses.append(float(out["loss"]))  # the step's sync point
            grad_norms.append(float(out["grad_norm"]))
            engine.wait()
            step_times.append(time.perf_counter() - ts)
        compiles.append(compiled)
        print(f"step {len(losses)}: loss {losses[-1]:.4f}, {step_times[-1]:.3g} s "
              f"({compiled['count']} compiles, {compiled['seconds']:.3g} s)", flush=True)
        if args.json:  # a run cut short by a timeout still leaves the steps it finished
            rss["after_steps"] = maxrss_bytes()
            write_json(args.json, make_record(args, cfg, dev, jax, m, tokens, rss, measured(),
                                              run_plan, None, predicted))
    rss["after_steps"] = maxrss_bytes()
    run = measured()

    estimate = None
    if args.dense_estimate:
        toks0 = toks[0, 0]
        estimate = {"long_context": memory_estimate(jax, engine, toks0)}
        engine.close()
        del engine
        dense = build_engine(make_config(args, dense=True), offload_activations=False)
        estimate["dense"] = memory_estimate(jax, dense, toks0)
        dense.close()
    else:
        engine.close()

    record = make_record(args, cfg, dev, jax, m, tokens, rss, run, run_plan, estimate, predicted)
    print_table(record)
    if args.json:
        write_json(args.json, record)
        print(f"wrote {args.json}")
    if args.max_rss_gb is not None and rss["after_steps"] > args.max_rss_gb * GB:
        from megatrain_jax.errors import TrainingError
        raise TrainingError(f"peak RSS {rss['after_steps'] / GB:.3f} GB exceeds --max-rss-gb "
                            f"{args.max_rss_gb:g}")


def make_record(args, cfg, dev, jax, m, tokens, rss, run, run_plan, estimate, predicted) -> dict:
    return {"kind": "long_context", "date": time.strftime("%Y-%m-%dT%H:%M:%S"),
            "command": " ".join([sys.executable, *sys.argv]), "jax": jax.__version__,
            "python": platform.python_version(), "device_kind": dev.device_kind,
            "platform": dev.platform, "params": m.num_params(), "tokens_per_step": tokens,
            "config": _to_dict(cfg), "attention": run_plan.attention_runs,
            "peak_rss_bytes": dict(rss), "run": run, "plan": plan_record(run_plan),
            "step_time": predicted, "dense_estimate": estimate, "max_rss_gb": args.max_rss_gb}


def step_time_prediction(cfg, machine, run_plan) -> dict:
    """The step-time model's step (megatrain_jax.step_time) for this run on an accelerator with
    the machine's peak and bus (a CPU: the model's defaults, an H100's): what the measured step
    is held against on a GPU."""
    from megatrain_jax import step_time
    shape = step_time.step_shape(cfg, run_plan.offload_activations, bus=run_plan.bus,
                                 execution=run_plan.execution)
    rates, sources, _ = step_time.resolve_rates(machine, {})
    p = step_time.simulate(shape, rates)
    return {"step_s": p.step_s, "bound": p.bound, "critical_path_s": p.critical_s,
            "device_tflops": rates.device_tflops, "rate_sources": sources,
            "layer_round_trips": [shape.layer_fwd_round_trips, shape.layer_bwd_round_trips]}


def write_json(path, record):
    os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
    with open(path, "w") as f:
        json.dump(record, f, indent=1)


@contextlib.contextmanager
def count_compiles():
    """XLA compilations while the block runs: {"count", "seconds"} (jax.monitoring's backend
    compile event). A step after the first that compiles is a step that is not yet steady."""
    import jax
    seen = {"count": 0, "seconds": 0.0}

    def on_event(event, seconds, **_):
        if event == "/jax/core/compile/backend_compile_duration":
            seen["count"] += 1
            seen["seconds"] += seconds

    jax.monitoring.register_event_duration_secs_listener(on_event)
    try:
        yield seen
    finally:
        jax.monitoring.unregister_event_duration_listener(on_event)


def model_flops(cfg) -> float:
    """Training FLOPs per token (megatrain_jax.flops.flops_per_token: 6 per matmul parameter plus
    causal attention)."""
    from megatrain_jax.flops import flops_per_token
    return flops_per_token(cfg.model, cfg.data.seq_len)


def _to_dict(cfg):
    from megatrain_jax.config import to_dict
    return to_dict(cfg)


def plan_record(p) -> dict:
    """The plan's figures (megatrain_jax.plan.Plan), without `largest_*` (more compiles)."""
    return {"summary": p.summary(), "host": dict(p.host), "host_total": p.host_total,
            "device": {phase: dict(kinds) for phase, kinds in p.device.items()},
            "device_peak": p.device_peak, "peak_phase": p.peak_phase,
            "workspace": dict(p.workspace), "fits": p.fits,
            "offload_activations": p.offload_activations, "attention": p.attention,
            "attention_runs": p.attention_runs, "attention_reason": p.attention_reason,
            "attention_notice": p.attention_notice}


def memory_estimate(jax, engine, tokens) -> dict:
    """XLA's memory analysis of `engine`'s block backward and loss head for one micro-batch of
    `tokens` (B, T), compiled from abstract shapes (nothing runs, nothing is allocated)."""
    import jax.numpy as jnp
    abstract = lambda x, dtype=None: jax.ShapeDtypeStruct(x.shape, dtype or x.dtype)
    inputs = jax.ShapeDtypeStruct(tokens.shape, jnp.int32)
    f = engine.device_functions(inputs, inputs)
    cdt, f32 = engine.compute_dtype, jnp.float32
    layer = jax.tree.map(lambda p: abstract(p, cdt), engine.unit_shapes()[1])
    stage_leaves = [abstract(p, cdt) for p in jax.tree.leaves(engine.param_shapes()["stages"])]
    w_first = engine.parts.take("first", stage_leaves)
    w_last = engine.parts.take("last", stage_leaves)
    stacked = jax.ShapeDtypeStruct((1, *tokens.shape), jnp.int32)  # a step of one micro-batch
    xs = jax.eval_shape(f.embed, w_first, stacked)
    x = jax.ShapeDtypeStruct(xs.shape[1:], xs.dtype)
    to32 = lambda tree: jax.tree.map(lambda p: abstract(p, f32), tree)

    def analyse(fn, *shapes):
        t0 = time.perf_counter()
        stats = fn.lower(*shapes).compile().memory_analysis()
        if stats is None:
            return {"error": "no memory_analysis() on this backend"}
        temp, arg = stats.temp_size_in_bytes, stats.argument_size_in_bytes
        out, alias = stats.output_size_in_bytes, stats.alias_size_in_bytes
        return {"temp_bytes": temp, "argument_bytes": arg, "output_bytes": out,
                "alias_bytes": alias, "total_bytes": arg + out + temp - alias,
                "compile_s": time.perf_counter() - t0}

    constants = jax.tree.map(abstract, engine.block_constants[0])
    return {"block_bwd": analyse(f.block_bwd, (layer, constants), x, None, x, to32(layer)),
            "head": analyse(f.head, w_last, xs, stacked)}


def print_table(r):
    gb = lambda b: "n/a" if b is None else f"{b / GB:.3g}"
    run, rss, p = r["run"], r["peak_rss_bytes"], r["plan"]
    times = ", ".join(f"{t:.3g}" for t in run["step_times_s"]) or "none"
    rows = [
        ("peak RSS at start GB", gb(rss["start"]), "ru_maxrss: Python + JAX runtime"),
        ("peak RSS before engine GB", gb(rss["before_engine"]), "after the plan (its compiles)"),
        ("peak RSS after engine GB", gb(rss["after_engine"]),
         f"built in {run['build_s']:.1f} s (host state: params, Adam, bus copies)"),
        ("peak RSS after steps GB", gb(rss["after_steps"]),
         f"+{gb(rss['after_steps'] - rss['before_engine'])} GB over the runtime"),
        ("step time s", f"{run['step_s']:.3g}" if "step_s" in run else "n/a",
         f"per step: {times} (the first compiles), each to the end of its host update; mean of "
         f"the {run.get('step_s_measured_over')}"),
        ("tokens/s", f"{run['tokens_per_s']:,.0f}" if "tokens_per_s" in run else "n/a",
         f"{r['tokens_per_step']:,} tokens/step"),
        ("model TFLOP/s", f"{run['model_tflops']:.3g}" if "model_tflops" in run else "n/a",
         "6 x matmul params + causal attention per token; recompute not counted"),
        ("device peak GB", gb(run["device_peak_bytes"]),
         "memory_stats peak_bytes_in_use" + (f" of a {gb(run['device_bytes_limit'])} GB limit"
                                             if run["device_bytes_limit"] else " (n/a on CPU)")),
        ("losses", " ".join(f"{x:.4f}" for x in run["losses"]) or "none",
         f"ln(vocab) = {math.log(r['config']['model']['vocab_size']):.4f}"),
        ("H2D / D2H GB", f"{gb(run['bytes_h2d'])} / {gb(run['bytes_d2h'])}",
         f"all steps; host update {run['host_update_s']:.2f} s, exposed {run['host_wait_s']:.2f} s"),
        ("plan: host GB", gb(p["host_total"]), _parts(p["host"])),
        ("plan: device peak GB", gb(p["device_peak"]),
         f"in the {p['peak_phase']}: " + _parts(p["device"][p["peak_phase"]])),
        ("attention", "", r["attention"]),
        ("step-time model s", f"{r['step_time']['step_s']:.3g}",
         f"bound by {r['step_time']['bound']} at {r['step_time']['device_tflops']:g} TFLOP/s "
         f"(megatrain_jax.step_time; on a CPU an H100's rates)"),
        ("plan vs measured GB", f"{gb(p['host_total'] + p['device_peak'])}",
         f"host + device predicted (one RAM on a CPU) vs {gb(rss['after_steps'] - rss['before_engine'])}"
         f" GB measured over the runtime"),
    ]
    est = r["dense_estimate"]
    if est:
        for fn, label in (("block_bwd", "block backward"), ("head", "loss head")):
            for path in ("long_context", "dense"):
                e = est[path][fn]
                if "error" in e:
                    rows.append((f"{label}, {path}", "n/a", e["error"]))
                    continue
                rows.append((f"{label}, {path.replace('_', '-')} GB", gb(e["temp_bytes"]),
                             f"XLA temporaries (compiled, not run); with arguments and outputs "
                             f"{gb(e['total_bytes'])} GB"))
    print(f"\nlong context, {r['device_kind']} ({r['platform']}), {r['params'] / 1e6:.2f}M params, "
          f"{r['tokens_per_step']:,} tokens/step")
    for name, value, note in rows:
        print(f"  {name:<30} {value:>14}   {note}")
    if run.get("main_thread_profile"):
        from megatrain_jax.profiling import format_rows
        print("\nthe dispatching thread, per step after the first (cProfile; own time, "
              "cumulative, calls):")
        print("\n".join(format_rows(run["main_thread_profile"])))


def _parts(parts: dict) -> str:
    """Kind -> bytes as 'kind 1.23, ...' in GB, the zero ones left out."""
    return ", ".join(f"{k} {v / GB:.3g}" for k, v in parts.items() if v)


if __name__ == "__main__":
    sys.exit(main())
