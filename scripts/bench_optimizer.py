"""The engine's host update against torch's CPU AdamW, at all cores and at one.

    python scripts/bench_optimizer.py                      # ~300M params, AdamW, 5 repetitions
    python scripts/bench_optimizer.py --params 150 --reps 3 --json out.json
    python scripts/bench_optimizer.py --state-dtype bfloat16   # Adam moments in bf16

Builds a StreamedEngine holding a Llama-shaped model of about --params million parameters (state on
the CPU, compute on the same CPU device, so the bus copy is a plain host buffer), then times the
engine's own host update path (`engine.apply_gradients` for every unit with the global norm and
the scale 1/sum(weight), each unit's bus copy released as in a step, then `wait`) with gradients
already on the host, as a step leaves them. Twice: as in a step, each gradient freed by the host thread once its update is
done (with train()'s mmap threshold, --mmap-threshold 1, that unmaps it: a cost of its own,
docs/results/2026-11-26-host-optimizer.md, freeing the gradients), and with the gradients held
until after the timing ("its gradients kept": the update's own time, as torch's, whose gradients
persist). In the same process, interleaved with it: `torch.optim.AdamW` (`fused=True`, then the
same followed by a copy of the new weights into bf16 tensors, the copy a streamed trainer sends
to the device and the engine's update writes in its own pass, and `foreach=True`) on fp32 tensors
of the same sizes as the engine's leaves, with the project's AdamW settings, and a numpy copy
between existing buffers of the same total size.

Run at all the cores this process may use (`--cores N`: the first N), then again in a child
process under `taskset -c` one core (XLA:CPU and the fused kernel size their threads from the
affinity mask; torch gets `set_num_threads`). `--processes K` repeats both in K fresh processes,
alternating: the same work varies by tens of percent between processes on a shared VM (where the
buffers land), so the table pools every process's samples and each ratio is the median of the
processes' own ratios. Bytes an update touches: the engine 24 B/param (read param, m, v; write
them; 16 with --state-dtype bfloat16, the moments 2 B each) + the gradient (4 B, 2 with
--grad-dtype bfloat16) + the bf16 bus copy it writes (2 B);
torch 28 B/param (fp32 gradient, no bus copy), 34 with its bf16 copy (read 4, write 2). Page
faults: minor faults of the process per update. CPU ms: CPU time of the whole process per update
(all its threads; on a machine shared with other jobs, the one-thread rows' CPU time is what a
neighbour's load disturbs least: wall time there also counts the time the core ran someone else;
at several threads it also counts threads spinning while they wait, torch's OpenMP pool's among
them). The last lines: the engine's update over torch fused's at one thread (wall and CPU time),
over torch fused followed by its bf16 copy, its gradients kept over torch fused, and last
`update_vs_torch_fused: R`, the engine's update time over torch fused's at all cores (<= 1: the
engine is as fast).
"""

import argparse
import json
import os
import subprocess
import sys
import tempfile
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
                    help="compute on a second CPU device, so the engine takes the path it takes "
                         "with a GPU: gradients and bus copies in that device's pinned host memory")
parser.add_argument("--grad-dtype", default="float32", choices=["float32", "bfloat16"],
                    help="the engine's gradient store (train.grad_dtype)")
parser.add_argument("--state-dtype", default="float32", choices=["float32", "bfloat16"],
                    help="the Adam moments' dtype (optimizer.state_dtype); torch's stay fp32")
parser.add_argument("--optax", action="store_true",
                    help="the engine runs plain optax.adamw (XLA's loops) instead of the fused update "
                         "(recipes.build_optimizer's); CXX=/nonexistent runs the fused update's JAX "
                         "fallback instead of its kernel")
parser.add_argument("--mmap-threshold", type=float, default=0,
                    help="glibc's mmap threshold in MiB, set before the state is made, as train() "
                         "sets it (1) (hostmem.set_mmap_threshold; 0: glibc's default, adaptive)")
parser.add_argument("--huge-pages", action="store_true",
                    help="glibc's allocations on transparent huge pages, as the training commands "
                         "run (hostmem.with_huge_pages: this command runs itself again with the "
                         "tunable, where the kernel allows)")
parser.add_argument("--no-one-core", action="store_true", help="skip the one-core child run")
parser.add_argument("--processes", type=int, default=1,
                    help="repeat every measurement in this many fresh processes (the same work "
                         "varies by tens of percent between processes on a shared VM): the table "
                         "pools their samples, the ratios are the median of each process's")
parser.add_argument("--child-json", default="", help=argparse.SUPPRESS)  # the one-core child
parser.add_argument("--json", default="", help="also write the results here")
args = parser.parse_args()
if args.optax and args.state_dtype != "float32":
    parser.error("--optax runs plain optax.adamw, whose moments are fp32: drop --state-dtype")
if args.cores:  # before jax starts: XLA:CPU sizes its thread pool from the affinity mask
    os.sched_setaffinity(0, sorted(os.sched_getaffinity(0))[:args.cores])
if args.huge_pages:  # the process is replaced (the affinity is kept); the package imports jax
    from megatrain_jax import hostmem
    hostmem.with_huge_pages()

import concurrent.futures  # noqa: E402
import resource  # noqa: E402

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402

if args.accelerator_path:
    jax.config.update("jax_num_cpu_devices", 2)
import numpy as np  # noqa: E402
import optax  # noqa: E402

from megatrain_jax import hostmem  # noqa: E402
from megatrain_jax.config import OptimizerConfig  # noqa: E402
from megatrain_jax.engine import StreamedEngine, fused_adamw  # noqa: E402
from megatrain_jax.model import ModelConfig, make_block, make_stages  # noqa: E402
from megatrain_jax.recipes import build_optimizer  # noqa: E402

try:
    import torch
except ImportError:  # a test dependency: without it, the engine's rows only
    torch = None

THREADS = len(os.sched_getaffinity(0))  # XLA:CPU's intra-op pool follows the affinity mask


def model_config(params_m: float, hidden: int) -> ModelConfig:
    one = ModelConfig(vocab_size=257, hidden_size=hidden, intermediate_size=int(2.75 * hidden),
                      num_layers=1, num_heads=hidden // 128, num_kv_heads=hidden // 128)
    layers = max(1, round(params_m * 1e6 / one.num_params(include_embeddings=False)))
    return ModelConfig(**{**one.__dict__, "num_layers": layers})


def make_copy(n, pool):
    """numpy copyto between two existing fp32 buffers of n elements, split over THREADS."""
    s, d = np.full(n, 1.0, np.float32), np.full(n, 0.0, np.float32)  # written now: no faults later
    bounds = np.linspace(0, n, THREADS + 1).astype(int)
    parts = [(d[a:b], s[a:b]) for a, b in zip(bounds[:-1], bounds[1:])]
    return lambda: list(pool.map(lambda part: np.copyto(*part), parts))  # releases the GIL


def make_torch(sizes, opt_cfg, mode, bus=False):
    """torch.optim.AdamW(mode=True) over fp32 tensors of `sizes` elements, gradients set. `bus`:
    each step then copies the new weights into bf16 tensors (torch._foreach_copy_), the copy a
    streamed trainer sends to the device, which the engine's update writes in the same pass."""
    params = [torch.nn.Parameter(torch.zeros(n)) for n in sizes]
    for p in params:
        p.grad = torch.full_like(p, 1e-3)
    opt = torch.optim.AdamW(params, lr=opt_cfg.learning_rate, betas=(opt_cfg.b1, opt_cfg.b2),
                            eps=opt_cfg.eps, weight_decay=opt_cfg.weight_decay, **{mode: True})
    opt.step()  # its state, made now
    if not bus:
        return opt.step
    buses = [torch.zeros(n, dtype=torch.bfloat16) for n in sizes]  # written now: no faults later

    def step():
        opt.step()
        with torch.no_grad():
            torch._foreach_copy_(buses, params)
    return step


def timed(fn):
    """(wall seconds, CPU seconds of the whole process, minor page faults) of one call."""
    faults = resource.getrusage(resource.RUSAGE_SELF).ru_minflt
    t0, c0 = time.perf_counter(), time.process_time()
    fn()
    return (time.perf_counter() - t0, time.process_time() - c0,
            resource.getrusage(resource.RUSAGE_SELF).ru_minflt - faults)


def measure() -> dict:
    """Every measurement at this process's cores: {name: {"seconds": [...], "faults": [...]}}."""
    if args.mmap_threshold:
        hostmem.set_mmap_threshold(int(args.mmap_threshold * 2**20))
    cfg = model_config(args.params, args.hidden)
    compute, host = jax.devices("cpu")[:2] if args.accelerator_path else [jax.devices("cpu")[0]] * 2
    opt_cfg = OptimizerConfig(state_dtype=args.state_dtype)
    optimizer = build_optimizer(opt_cfg, 1000)
    if args.optax:
        optimizer = optax.adamw(optimizer.hyper.learning_rate, b1=opt_cfg.b1, b2=opt_cfg.b2,
                                eps=opt_cfg.eps, weight_decay=opt_cfg.weight_decay,
                                mask=optimizer.hyper.mask)
    grad_dtype = jnp.dtype(args.grad_dtype)
    # Where a step leaves each gradient: the compute device's pinned host memory on the
    # accelerator path (the direct update reads it there), else the host device
    where = (jax.sharding.SingleDeviceSharding(compute, memory_kind="pinned_host")
             if args.accelerator_path else jax.sharding.SingleDeviceSharding(host))

    def engine_runs(host_update):
        """(the engine, its update as in a step, the same with its gradients kept, the leaves'
        sizes) for one way of running the host update."""
        first, last = make_stages(cfg, 0)
        engine = StreamedEngine(first=first, last=last,
                                make_block=lambda i: make_block(cfg, 0, i),
                                num_layers=cfg.num_layers, optimizer=optimizer,
                                max_grad_norm=1.0 if args.clip else None,
                                compute_dtype=jnp.bfloat16, compute_device=compute,
                                host_device=host, grad_dtype=grad_dtype, host_update=host_update)
        del first, last
        shapes = engine.unit_shapes()  # (a held view of the state would make every update
        # copy its unit first)
        units = range(len(shapes))
        fill = lambda p: jax.device_put(
            jax.tree.map(lambda x: jnp.full(x.shape, 1e-3, grad_dtype), p), where)
        # The global norm of the scaled gradient (below max_grad_norm: clipping changes nothing)
        # and the scale 1 / sum(weight), as the step leaves them.
        norm, scale = jax.device_put((jnp.float32(0.5), jnp.float32(1.0)), where)
        send, kept = {}, []

        def send_grads():  # untimed: as the step leaves them, each unit's gradient in
            # grad_dtype; fresh each time, since the update may take a gradient's buffer over
            # (donation)
            for u in units:
                send[u] = fill(shapes[u])
            jax.block_until_ready(send)

        def update():  # the engine's own path: every unit's update on its host thread, then
            # wait; each gradient is freed on the host thread once its update is done, as in a step
            for u in units:
                engine.apply_gradients({u: send.pop(u)}, norm, scale)
            engine.wait()

        def update_kept():  # the same, the gradients freed after the timing (torch keeps its own)
            kept.append(dict(send))
            update()
            kept.clear()

        sizes = [x.size for p in shapes for x in jax.tree.leaves(p)]
        return engine, send_grads, update, update_kept, sizes, shapes

    engine, send_grads, update, update_kept, leaf_sizes, unit_params = engine_runs("auto")
    updates = {"update": (send_grads, update), "update_kept": (send_grads, update_kept)}
    direct = engine.host_update == "direct"
    jit_engine = None
    if direct:  # the same kernel through jax.ffi in a jitted update per unit, side by side
        jit_engine, jit_send, jit_update = engine_runs("jit")[:3]
        updates["update_jit"] = (jit_send, jit_update)
    units = unit_params

    pool = concurrent.futures.ThreadPoolExecutor(THREADS)
    runs = {"copy": make_copy(sum(leaf_sizes), pool)}
    if torch is not None:
        torch.set_num_threads(THREADS)
        runs.update({"torch_fused": make_torch(leaf_sizes, opt_cfg, "fused"),
                     "torch_fused_bus": make_torch(leaf_sizes, opt_cfg, "fused", bus=True),
                     "torch_foreach": make_torch(leaf_sizes, opt_cfg, "foreach")})
    for prepare, fn in updates.values():
        prepare()
        fn()  # compile
    for fn in runs.values():
        fn()
    # Interleaved, so a neighbour's load on this shared machine hits every run alike.
    out = {k: {"seconds": [], "cpu_seconds": [], "faults": []} for k in [*updates, *runs]}
    for _ in range(args.reps):
        for k, fn in [*((k, fn) for k, (_, fn) in updates.items()), *runs.items()]:
            if k in updates:
                updates[k][0]()
            for key, x in zip(("seconds", "cpu_seconds", "faults"), timed(fn)):
                out[k][key].append(x)
    pool.shutdown()
    engine.close()
    if jit_engine is not None:
        jit_engine.close()
    return {"params": sum(leaf_sizes), "units": len(units), "layer_params": sum(
        x.size for x in jax.tree.leaves(unit_params[1])), "runs": out,
        "native_kernel": not args.optax and fused_adamw.native(), "direct": direct,
        "huge_pages": hostmem.huge_pages_on(), "thp_mode": hostmem.thp_setting(),
        "mmap_threshold_mib": args.mmap_threshold}


def child(one_core: bool) -> dict:
    """The same measurements in a fresh child process: at this process's cores, or pinned to its
    first core."""
    with tempfile.TemporaryDirectory() as tmp:
        out = os.path.join(tmp, "child.json")
        argv = [f"--params={args.params}", f"--hidden={args.hidden}", f"--reps={args.reps}",
                f"--grad-dtype={args.grad_dtype}", f"--state-dtype={args.state_dtype}",
                *(["--clip"] if args.clip else []),
                *(["--accelerator-path"] if args.accelerator_path else []),
                *(["--optax"] if args.optax else []), f"--mmap-threshold={args.mmap_threshold}",
                *(["--huge-pages"] if args.huge_pages else [])]
        pin = ["taskset", "-c", str(min(os.sched_getaffinity(0)))] if one_core else []
        cmd = [*pin, sys.executable, os.path.abspath(__file__), *argv, "--child-json", out]
        subprocess.run(cmd, check=True)
        with open(out) as f:
            return json.load(f)


def ratios(res: dict) -> dict:
    """One process's medians: the engine's update (as in a step, and its gradients kept) over
    torch fused's, and over torch fused's followed by its bf16 copy."""
    ms = {k: float(np.median(run["seconds"])) for k, run in res["runs"].items()}
    torch_ms = lambda k: ms.get(k, float("nan"))
    return {"update_vs_torch_fused": ms["update"] / torch_ms("torch_fused"),
            "update_jit_vs_torch_fused": ms.get("update_jit", float("nan")) / torch_ms("torch_fused"),
            "update_kept_vs_torch_fused": ms["update_kept"] / torch_ms("torch_fused"),
            "update_vs_torch_fused_bus": ms["update"] / torch_ms("torch_fused_bus")}


def pooled(per_process: list) -> dict:
    """The processes' measurements as one: every run's samples together."""
    runs = {k: {key: [x for r in per_process for x in r["runs"][k][key]] for key in run}
            for k, run in per_process[0]["runs"].items()}
    return {**per_process[0], "runs": runs}


def main():
    if args.child_json:
        with open(args.child_json, "w") as f:
            json.dump(measure(), f)
        return
    counts = [THREADS] + ([1] if THREADS > 1 and not args.no_one_core else [])
    per = {t: [] for t in counts}
    for k in range(args.processes):  # alternating thread counts, each in a fresh process
        for t in counts:  # (one process: the all-core run in this one, as before)
            per[t].append(measure() if args.processes == 1 and t == THREADS
                          else child(one_core=t == 1 and THREADS > 1))
    results = {t: pooled(runs) for t, runs in per.items()}
    per_process = {t: [ratios(r) for r in runs] for t, runs in per.items()}
    r = results[THREADS]
    n = r["params"]
    grad_bytes = jnp.dtype(args.grad_dtype).itemsize
    state_bytes = 2 * (4 + 2 * jnp.dtype(args.state_dtype).itemsize)  # param, m, v: read, written
    bytes_per_param = {"update": state_bytes + grad_bytes + 2,
                       "update_kept": state_bytes + grad_bytes + 2,
                       "update_jit": state_bytes + grad_bytes + 2,
                       "torch_fused": 28, "torch_fused_bus": 34, "torch_foreach": 28, "copy": 8}
    names = {"update": "engine host update", "update_kept": "  its gradients kept",
             "update_jit": "  the kernel in a jit",
             "torch_fused": "torch AdamW fused", "torch_fused_bus": "  + its bf16 copy",
             "torch_foreach": "torch AdamW foreach", "copy": "numpy copy"}
    path = "optax" if args.optax else "fused, " + (
        ("kernel called directly" if r["direct"] else "kernel") if r["native_kernel"] else "JAX")
    print(f"model: {n / 1e6:.1f}M params, {r['units'] - 2} layers of {r['layer_params'] / 1e6:.1f}M "
          f"and the 2 stage units | "
          f"AdamW ({path}), {args.state_dtype} moments, bf16 bus copy, "
          f"{args.grad_dtype} gradients, clipping {'on' if args.clip else 'off'}, "
          f"{'accelerator path (gradients and bus copies in pinned memory)' if args.accelerator_path else 'bus on the host device'}"
          f"{f', mmap threshold {args.mmap_threshold:g} MiB' if args.mmap_threshold else ''}"
          f"{', huge pages' if r['huge_pages'] else ''}"
          f" | median of {args.reps}, interleaved"
          f"{f', in each of {args.processes} processes (ratios: median of the processes)' if args.processes > 1 else ''}")
    print(f"{'measurement':26s} {'threads':>7s} {'B/param':>7s} {'time ms':>9s} {'GB/s':>7s} "
          f"{'Mparams/s':>10s} {'page faults':>12s} {'CPU ms':>8s}")
    table = []
    for threads, res in sorted(results.items(), reverse=True):
        for k, run in res["runs"].items():
            sec = float(np.median(run["seconds"]))
            row = {"measurement": k, "threads": threads, "bytes_per_param": bytes_per_param[k],
                   "ms": sec * 1e3, "gb_s": bytes_per_param[k] * n / sec / 1e9,
                   "mparams_per_s": n / sec / 1e6, "page_faults": int(np.median(run["faults"])),
                   "cpu_ms": float(np.median(run["cpu_seconds"])) * 1e3}
            table.append(row)
            print(f"{names[k]:26s} {threads:7d} {row['bytes_per_param']:7d} {row['ms']:9.1f} "
                  f"{row['gb_s']:7.2f} {row['mparams_per_s']:10.0f} {row['page_faults']:12d} "
                  f"{row['cpu_ms']:8.1f}")
    median = lambda t, key: float(np.median([x[key] for x in per_process.get(t, [])] or [np.nan]))
    ratio, ratio_1 = median(THREADS, "update_vs_torch_fused"), median(1, "update_vs_torch_fused")
    ratio_kept = median(THREADS, "update_kept_vs_torch_fused")
    ratio_bus = median(THREADS, "update_vs_torch_fused_bus")
    cpu = {(row["measurement"], row["threads"]): row["cpu_ms"] for row in table}
    cpu_ratio_1 = cpu.get(("update", 1), float("nan")) / cpu.get(("torch_fused", 1), float("nan"))
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"params": n, "units": r["units"], "layer_params": r["layer_params"],
                       "threads": THREADS, "table": table, "results": results,
                       "update_gb_s": next(row["gb_s"] for row in table if row["threads"] == THREADS
                                           and row["measurement"] == "update"),
                       "bytes_per_param_touched": bytes_per_param["update"],
                       "native_kernel": r["native_kernel"], "optax": args.optax, "clip": args.clip,
                       "accelerator_path": args.accelerator_path, "grad_dtype": args.grad_dtype,
                       "state_dtype": args.state_dtype,
                       "mmap_threshold_mib": args.mmap_threshold, "huge_pages": r["huge_pages"],
                       "thp_mode": r["thp_mode"],
                       "update_vs_torch_fused": ratio, "update_vs_torch_fused_1": ratio_1,
                       "update_kept_vs_torch_fused": ratio_kept,
                       "update_vs_torch_fused_bus": ratio_bus, "processes": args.processes,
                       "update_jit_vs_torch_fused": median(THREADS, "update_jit_vs_torch_fused"),
                       "direct": r["direct"],
                       "per_process": {str(t): x for t, x in per_process.items()},
                       "update_vs_torch_fused_1_cpu": cpu_ratio_1, "jax": jax.__version__,
                       "torch": torch.__version__ if torch else None}, f, indent=1)
    if args.processes > 1:
        for t, xs in sorted(per_process.items(), reverse=True):
            print(f"per process, {t} thread(s), update / torch fused: "
                  + ", ".join(f"{x['update_vs_torch_fused']:.3f}" for x in xs))
    print(f"at one thread, update / torch fused: {ratio_1:.3f} (wall), {cpu_ratio_1:.3f} (CPU)")
    print(f"update / (torch fused + its bf16 copy): {ratio_bus:.3f}")
    if r["direct"]:
        print(f"the kernel in a jit / torch fused: "
              f"{median(THREADS, 'update_jit_vs_torch_fused'):.3f}")
    print(f"its gradients kept, update / torch fused: {ratio_kept:.3f}")
    print(f"update_vs_torch_fused: {ratio:.3f}")


if __name__ == "__main__":
    sys.exit(main())
