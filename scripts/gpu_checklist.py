"""The GPU checklist (docs/gpu-checklist.md): every benchmark of a GPU run, each under its own
timeout, in parts of at most 10 minutes each; run them in order.

    python3 scripts/gpu_checklist.py 1    # machine, transfers, bench_1b, host update, step-time
                                          # prediction against bench_1b, the engine's tests
    python3 scripts/gpu_checklist.py 2    # the 1M-token plan compiled on the GPU; long context:
                                          # Llama-3-8B shapes (4 layers) at 128K
    python3 scripts/gpu_checklist.py 3    # bench_4b in an 11 GB device cap, host update on 16 / 1
                                          # cores, step-time prediction against bench_4b
    python3 scripts/gpu_checklist.py 4    # long context at 256K
    python3 scripts/gpu_checklist.py 5    # what holds a streamed step: bench_1b's and the 128K
                                          # step's dispatching thread profiled; bench_1b at 64K
                                          # tokens a step against resident
    python3 scripts/gpu_checklist.py 6    # one call per layer: bench_1b at 32K and 64K against
                                          # resident, host lookup on / off, a layer call's dispatch
                                          # against a bare jit (command buffers on / off), the
                                          # update on 15 threads with the dispatcher profiled
    python3 scripts/gpu_checklist.py 7    # long context at the device's speed: one layer's
                                          # backward per way a tiled block attends, and the
                                          # 128K step of part 2 with the tiled block's loops
                                          # known (issue 46)
    python3 scripts/gpu_checklist.py 8    # what is left on the dispatching thread: the layer
                                          # calls and bench_1b with while loops in XLA's command
                                          # buffers, against the default; the bus ring against
                                          # resident bus copies
    python3 scripts/gpu_checklist.py 1 2 3 4 5 --smoke --out /tmp/smoke   # on a CPU, tiny sizes

Results go to the folder $OUT names when it is set, else to --out DIR: per part part<N>.txt
(every command and its output, in order), part<N>.json (the steps: command, exit status, seconds,
timed out or skipped; rewritten after each step, so a part cut short still says how far it got)
and the JSON each benchmark writes. A part writes at most MAX_FILES files (few enough to copy
whole into docs/results/) and its steps' timeouts together stay within PART_BUDGET_S, under the
part's 10 minutes; a step never runs past what is left of that budget.

--smoke runs the same steps with tiny sizes (each step's own small command line, in STEPS) on
whatever machine this is; steps that need an NVIDIA GPU (nvidia-smi) are skipped. --only picks
steps by name. The exit status is 0 when every step that ran exited 0, else 1.
"""

import argparse
import dataclasses
import datetime
import json
import os
import platform
import signal
import subprocess
import sys
import time

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
PART_BUDGET_S = 560  # a part is at most 10 minutes (600 s); the rest is start-up and margin
MAX_FILES = 9  # a part's results stay a handful of files


@dataclasses.dataclass(frozen=True)
class Step:
    """One command of the checklist. `argv` starts with a script under scripts/ (run by this
    Python) or is a plain command; `smoke` is the same script with tiny sizes (None: `argv` is
    already cheap). `json` names the file the step writes in the results folder (passed as
    `--json PATH`). `env` is added to the environment."""
    name: str
    timeout_s: int
    argv: tuple
    smoke: tuple = None
    json: str = None
    env: tuple = ()  # (key, value) pairs
    needs_gpu: bool = False  # skipped under --smoke

    def command(self, smoke: bool, out: str) -> list:
        argv = list(self.smoke if smoke and self.smoke is not None else self.argv)
        argv = [a.replace("{out}", out) for a in argv]
        if argv[0].endswith(".py") or argv[0] == "-m":  # a script or module: this Python
            argv = [sys.executable, *argv]
        if self.json:
            argv += ["--json", os.path.join(out, self.json)]
        return argv


# The tiny model every smoke run of bench.py trains (as tests/test_bench.py).
TINY = ("--config", "configs/tiny.yaml", "model.num_layers=2", "data.seq_len=32",
        "data.batch_size=2", "data.micro_batches=2")
TINY_LONG = ("--seq-len", "256", "--vocab", "512", "--hidden", "32", "--layers", "1", "--heads",
             "2", "--kv-heads", "1", "--attention-block", "64", "--tile-size", "64",
             "--loss-chunk", "64", "--loss-vocab-chunk", "128")
TINY_OPTIMIZER = ("--params", "1", "--hidden", "256", "--reps", "1")
CPU_ONLY = (("JAX_PLATFORMS", "cpu"),)
ENGINE_TESTS = ("tests/test_streaming.py", "tests/test_engine.py", "tests/test_overlap.py")


def machine_steps(versions: bool) -> list:
    steps = [Step("nvidia-smi", 15, ("nvidia-smi", "--query-gpu=name,memory.total,"
                                     "pcie.link.gen.current,pcie.link.width.current,"
                                     "driver_version", "--format=csv"), needs_gpu=True),
             Step("memory and cores", 5, ("sh", "-c", "free -g; nproc"))]
    if versions:
        steps.append(Step("versions", 45, (sys.executable, "-c", (
            "import jax, flax, optax, orbax.checkpoint as o; print('jax', jax.__version__, 'flax', "
            "flax.__version__, 'optax', optax.__version__, 'orbax', o.__version__); "
            "print(jax.devices())"))))
    return steps


def long_context(name, seq, attention, steps, timeout, flags=()) -> Step:
    """Llama-3-8B's layer and vocabulary shapes with 4 layers: the device peak does not depend on
    the depth, and the host state (about 31 GB) fits the machine's RAM (the whole model: ~135 GB).
    XLA_PYTHON_CLIENT_MEM_FRACTION: the default 0.75 leaves a quarter of the GPU's memory unused."""
    return Step(name, timeout, ("scripts/bench_long_context.py", "--config", "configs/llama3_8b.yaml",
                                "--seq-len", str(seq), "--compute-dtype", "bfloat16", "--attention",
                                attention, "--steps", str(steps), *flags, "model.num_layers=4"),
                smoke=("scripts/bench_long_context.py", *TINY_LONG, "--attention", attention,
                       *flags),
                json=f"{name}.json", env=(("XLA_PYTHON_CLIENT_MEM_FRACTION", "0.92"),))


def step_time(name, config, timeout=40) -> Step:
    """The plan's step-time prediction from the rates measured in this part (transfer.json, the
    bench's device compute, optimizer.json's host update), set against the bench's measured step
    (`scripts/plan.py --step-time --rates DIR` finds the bench of the same step there)."""
    tail = ("--step-time", "--rates", "{out}")
    return Step(name, timeout, ("scripts/plan.py", "--config", config, *tail),
                smoke=("scripts/plan.py", *TINY, *tail), json=f"{name}.json")


STEPS = {
    1: [*machine_steps(versions=True),
        # 256 MB, no pool probe: a larger buffer with the pool probe ran past this timeout
        # (docs/results/2026-11-26-h100.md, on the checklist itself); the probe is part 3's
        # `pinned probe`
        Step("transfer", 90, ("scripts/bench_transfer.py", "--mb", "256", "--repeats", "3",
                              "--pinned-probe-gb", "0"),
             smoke=("scripts/bench_transfer.py", "--mb", "4", "--repeats", "2",
                    "--pinned-probe-gb", "0.01"), json="transfer.json"),
        # its JSON records the device's memory_stats() around the timed steps
        # (streamed.device_left_by_steps_gb: an unplanned device copy shows there, not 0)
        Step("bench_1b", 150, ("scripts/bench.py", "--config", "configs/bench_1b.yaml",
                               "--steps", "3"),
             smoke=("scripts/bench.py", *TINY, "--steps", "1", "--warmup", "1"),
             json="bench_1b.json"),
        # the engine's own update path with clipping, all cores: the host-update rate
        # JAX_PLATFORMS=cpu: the host update needs no GPU, and its one-core child could not
        # take the GPU memory the parent had preallocated (it ran out of memory)
        Step("optimizer", 100, ("scripts/bench_optimizer.py", "--clip", "--reps", "3"),
             smoke=("scripts/bench_optimizer.py", "--clip", *TINY_OPTIMIZER), json="optimizer.json",
             env=CPU_ONLY),
        step_time("step_time_1b", "configs/bench_1b.yaml"),
        # last: a first check that the engine's tests pass on this jax (CPU devices, as in CI)
        # on CPU devices as in CI (JAX_PLATFORMS=cpu: each pytest worker would otherwise
        # preallocate 75% of the one GPU, and all but the first ran out of memory)
        Step("engine tests", 100, ("-m", "pytest", "-q", "-x", "-p", "no:cacheprovider",
                                   *ENGINE_TESTS),
             smoke=("-m", "pytest", "-q", "-p", "no:cacheprovider", "--collect-only",
                    *ENGINE_TESTS), env=CPU_ONLY)],
    2: [*machine_steps(versions=False),
        # first: the million-token plan compiled by XLA:GPU itself (issue 25); its search for the
        # largest sequence compiles the step's functions at a few more lengths
        Step("plan_local", 130, ("scripts/plan.py", "--config", "configs/llama3_8b.yaml",
                                 "--device", "local", "--sweep", "1048576"),
             smoke=("scripts/plan.py", *TINY, "--device", "local", "--sweep", "32"),
             json="plan_local.json"),
        # the block tiled over the sequence (train.tile_size 8192): a step's device peak against
        # the plan's, at 128K and 256K
        # two steps: the first compiles (most of the timeout: docs/benchmarks.md, "A million
        # tokens compiled by XLA:GPU"), the second is the one measured; a part of its own for
        # 256K, whose first step takes longer
        long_context("long_128k_auto", 131072, "auto", 2, 400)],
    3: [*machine_steps(versions=False),
        # part 3's own bus rates for its prediction (names differ from part 1's: the parts'
        # results share a folder under docs/results/)
        Step("transfer", 50, ("scripts/bench_transfer.py", "--mb", "256", "--repeats", "3",
                              "--pinned-probe-gb", "0"),
             smoke=("scripts/bench_transfer.py", "--mb", "4", "--repeats", "2",
                    "--pinned-probe-gb", "0"), json="transfer_3.json"),
        # if it runs out of device memory, add data.micro_batches=4 (fewer saved activations)
        Step("bench_4b", 280, ("scripts/bench.py", "--config", "configs/bench_4b.yaml",
                               "--device-mem-gb", "11", "--baselines", "none", "--steps", "2"),
             smoke=("scripts/bench.py", *TINY, "--baselines", "none", "--steps", "1"),
             json="bench_4b.json"),
        # as the training commands run it: huge pages, train()'s mmap threshold (part 1's
        # optimizer step runs without either)
        Step("optimizer_16_cores", 50, ("scripts/bench_optimizer.py", "--clip", "--cores", "16",
                                        "--reps", "3", "--no-one-core", "--huge-pages",
                                        "--mmap-threshold", "1"),
             smoke=("scripts/bench_optimizer.py", "--clip", *TINY_OPTIMIZER),
             json="optimizer_16_cores.json", env=CPU_ONLY),
        Step("optimizer_1_core", 60, ("scripts/bench_optimizer.py", "--clip", "--cores", "1",
                                      "--reps", "2", "--no-one-core"),
             smoke=("scripts/bench_optimizer.py", "--clip", "--cores", "1", *TINY_OPTIMIZER),
             json="optimizer_1_core.json", env=CPU_ONLY),
        # XLA's pinned_host pool: default cap (64 GB) against the raised one
        Step("pinned probe", 60, ("scripts/bench_transfer.py", "--mb", "4", "--repeats", "1",
                                  "--pinned-probe-gb", "72"),
             smoke=("scripts/bench_transfer.py", "--mb", "4", "--repeats", "1",
                    "--pinned-probe-gb", "0.01"), json="pinned_probe.json"),
        step_time("step_time_4b", "configs/bench_4b.yaml")],
    4: [*machine_steps(versions=False),
        long_context("long_256k_auto", 262144, "auto", 2, 540)],
    # what holds a streamed step while the device is idle (docs/results/2026-11-27-h200-b.md:
    # bench_1b's dispatching thread spends most of a step outside its counted waits; the 128K
    # step takes far longer than its FLOPs)
    5: [*machine_steps(versions=False),
        # cProfile slows the thread it profiles: this run's step time is not a figure
        Step("bench_1b_profile", 110, ("scripts/bench.py", "--config", "configs/bench_1b.yaml",
                                       "--steps", "2", "--baselines", "none", "--profile-main"),
             smoke=("scripts/bench.py", *TINY, "--steps", "1", "--baselines", "none",
                    "--profile-main"), json="bench_1b_profile.json"),
        # twice the tokens a step, the resident run in the same process: the ratio at 64K
        Step("bench_1b_m16", 170, ("scripts/bench.py", "--config", "configs/bench_1b.yaml",
                                   "--steps", "3", "--baselines", "resident",
                                   "data.micro_batches=16"),
             smoke=("scripts/bench.py", *TINY, "--steps", "1", "--baselines", "resident"),
             json="bench_1b_m16.json"),
        long_context("long_128k_profile", 131072, "auto", 2, 260, flags=("--profile-main",))],
    # the dispatching thread with one call per layer (issue 45), under 8 minutes: the streamed
    # step against resident at 32K and 64K tokens; the first stage's two ways; a layer call's
    # dispatch against a bare jit of its arguments, with and without command buffers; the update
    # pool one core short of the machine, the dispatching thread profiled
    6: [*machine_steps(versions=False),
        Step("bench_1b_32k", 110, ("scripts/bench.py", "--config", "configs/bench_1b.yaml",
                                   "--steps", "3", "--baselines", "resident"),
             smoke=("scripts/bench.py", *TINY, "--steps", "1", "--warmup", "1", "--baselines",
                    "resident", "--cpu-devices", "2"), json="bench_1b_32k.json"),
        Step("bench_1b_64k", 130, ("scripts/bench.py", "--config", "configs/bench_1b.yaml",
                                   "--steps", "3", "--baselines", "resident",
                                   "data.micro_batches=16"),
             smoke=("scripts/bench.py", *TINY, "data.micro_batches=4", "--steps", "1", "--warmup",
                    "1", "--baselines", "resident", "--cpu-devices", "2"),
             json="bench_1b_64k.json"),
        *(Step(f"lookup_{way}_8l", 45, ("scripts/bench.py", "--config", "configs/bench_1b.yaml",
                                        "--steps", "2", "--baselines", "none",
                                        "model.num_layers=8", f"train.host_lookup={way}"),
               smoke=("scripts/bench.py", *TINY, f"train.host_lookup={way}", "--steps", "1",
                      "--warmup", "1", "--baselines", "none", "--cpu-devices", "2"),
               json=f"lookup_{way}_8l.json") for way in ("true", "false")),
        *(Step(name, 35, ("scripts/bench_layer_calls.py", "--config", "configs/bench_1b.yaml"),
               smoke=("scripts/bench_layer_calls.py", *TINY, "--reps", "1"), json=f"{name}.json",
               env=env) for name, env in (
                   ("layer_calls", ()),
                   ("layer_calls_no_command_buffers",
                    (("XLA_FLAGS", "--xla_gpu_enable_command_buffer="),)))),
        # lookup_false_8l is the same run on every core (optimizer.host_threads null)
        Step("threads_15_profile_8l", 50, ("scripts/bench.py", "--config", "configs/bench_1b.yaml",
                                           "--steps", "2", "--baselines", "none", "--profile-main",
                                           "model.num_layers=8", "train.host_lookup=false",
                                           "optimizer.host_threads=15"),
             smoke=("scripts/bench.py", *TINY, "optimizer.host_threads=1", "--steps", "1",
                    "--warmup", "1", "--baselines", "none", "--cpu-devices", "2",
                    "--profile-main"),
             json="threads_15_profile_8l.json")],
}


def tiled_attention_part() -> list:
    """Part 7 (at most 8 minutes): one Llama-3-8B layer's backward at 32,768 tokens in tiles of
    8,192 for each way a tiled block attends (blockwise in blocks of 512, 1,024 and 2,048, cuDNN's
    calls merged per query tile, cuDNN untiled with the MLP tiled) against the block untiled with
    cuDNN, with their gradients' differences (attention.MEASURED's figures); then part 2's 4-layer
    128K step with this code, two steps, its device peak and time against the plan's and the
    step-time model's (in its JSON)."""
    gpu_memory = (("XLA_PYTHON_CLIENT_MEM_FRACTION", "0.92"),)
    return [*machine_steps(versions=False),
            Step("tile_attention", 190, ("scripts/bench_tile_attention.py", "--reps", "3"),
                 smoke=("scripts/bench_tile_attention.py", "--config", "configs/tiny.yaml",
                        "--seq-len", "256", "--tile-size", "64", "--blocks", "16,32", "--reps",
                        "1"), json="tile_attention.json", env=gpu_memory),
            long_context("long_128k_tiled", 131072, "auto", 2, 250)]


STEPS[7] = tiled_attention_part()

# XLA:GPU's default command buffers hold fusions, cuBLAS and cuDNN calls, not while loops: a scan
# runs its loop from the host, launching its body's thunks at every step
WHILE_IN_COMMAND_BUFFERS = (("XLA_FLAGS", "--xla_gpu_enable_command_buffer=+WHILE,+CONDITIONAL"),)


def launch_part() -> list:
    """Part 8 (at most 6 minutes): what is left on the dispatching thread with one call per layer
    (docs/results/2026-11-28-h200.md: a layer backward's launch, 5.5 ms, is the executable's, not
    its arguments'): the layer calls' dispatch and bench_1b at 32K with XLA's command buffers
    holding while loops and conditionals too, each beside the default in the same part; then
    the bus ring against the resident bus copies without the profiler (the ring's cast runs on
    the dispatching thread: 0.21 s a step profiled)."""
    bench_1b = ("scripts/bench.py", "--config", "configs/bench_1b.yaml")
    smoke = ("scripts/bench.py", *TINY)
    steps, smoke_steps = ("--steps", "3"), ("--steps", "1", "--warmup", "1", "--cpu-devices", "2")
    return [*machine_steps(versions=False),
            *(Step(name, 35, ("scripts/bench_layer_calls.py", "--config", "configs/bench_1b.yaml"),
                   smoke=("scripts/bench_layer_calls.py", *TINY, "--reps", "1"),
                   json=f"{name}.json", env=env)
              for name, env in (("layer_calls_default", ()),
                                ("layer_calls_while", WHILE_IN_COMMAND_BUFFERS))),
            *(Step(name, 80, (*bench_1b, *steps, "--baselines", "none"),
                   smoke=(*smoke, *smoke_steps, "--baselines", "none"), json=f"{name}.json",
                   env=env)
              for name, env in (("bench_1b_32k_default", ()),
                                ("bench_1b_32k_while", WHILE_IN_COMMAND_BUFFERS))),
            Step("bench_1b_ring", 110, (*bench_1b, "offload.bus=ring", *steps, "--baselines",
                                        "resident"),
                 smoke=(*smoke, "offload.bus=ring", *smoke_steps, "--baselines", "resident"),
                 json="bench_1b_ring.json")]


STEPS[8] = launch_part()


def files_of(part: int) -> list:
    """The files a part writes: its log, its summary, and each step's JSON."""
    return [f"part{part}.txt", f"part{part}.json"] + [s.json for s in STEPS[part] if s.json]


def parse_args(argv):
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0],
                                formatter_class=argparse.RawDescriptionHelpFormatter,
                                epilog="Steps: " + "; ".join(
                                    f"part {n}: " + ", ".join(s.name for s in steps)
                                    for n, steps in STEPS.items()))
    p.add_argument("parts", nargs="+", type=int, choices=sorted(STEPS), metavar="PART",
                   help=f"{', '.join(map(str, sorted(STEPS)))} (several run one after the other)")
    p.add_argument("--smoke", action="store_true", help="tiny sizes, any machine (the test suite)")
    p.add_argument("--out", default="gpu_results", help="results folder when $OUT is unset")
    p.add_argument("--only", default="", help="comma-separated step names (default: all)")
    p.add_argument("--timeout", type=float, default=None,
                   help="every step's timeout in seconds, instead of its own")
    args = p.parse_args(argv)
    names = {s.name for n in args.parts for s in STEPS[n]}
    only = [n for n in args.only.split(",") if n]
    unknown = [n for n in only if n not in names]
    if unknown:
        p.error(f"--only: no step named {unknown[0]!r} in part(s) "
                f"{', '.join(map(str, args.parts))} (steps: {', '.join(sorted(names))})")
    args.only = set(only)
    return args


def run_step(step: Step, cmd: list, timeout: float, log) -> dict:
    """Runs cmd with its output appended to `log`; on timeout, its whole process group is ended
    (a benchmark's children too). Returns the step's record."""
    env = dict(os.environ, PYTHONPATH=ROOT, PYTHONUNBUFFERED="1", **dict(step.env))
    env.setdefault("XLA_PJRT_GPU_HOST_MEMORY_LIMIT_GB", "100")
    log.write(f"=== {datetime.datetime.now(datetime.timezone.utc):%Y-%m-%dT%H:%M:%SZ} "
              f"{step.name}, timeout {timeout:.0f} s: {' '.join(cmd)}\n")
    log.flush()
    t0 = time.perf_counter()
    record = {"name": step.name, "command": cmd, "timeout_s": timeout, "json": step.json}
    try:
        proc = subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT, cwd=ROOT, env=env,
                                start_new_session=True)
    except OSError as e:  # e.g. nvidia-smi missing
        log.write(f"{e}\n")
        record.update(rc=127, seconds=0.0, timed_out=False)
    else:
        try:
            rc, timed_out = proc.wait(timeout=timeout), False
        except subprocess.TimeoutExpired:
            _end_group(proc)
            rc, timed_out = 124, True
        record.update(rc=rc, seconds=round(time.perf_counter() - t0, 1), timed_out=timed_out)
    log.write(f"=== exit {record['rc']}{' (timed out)' if record['timed_out'] else ''} after "
              f"{record['seconds']} s\n")
    log.flush()
    return record


def _end_group(proc):
    """SIGTERM to the step's process group (started apart from ours), SIGKILL if it lingers."""
    for sig, grace in ((signal.SIGTERM, 10), (signal.SIGKILL, 10)):
        try:
            os.killpg(proc.pid, sig)
        except ProcessLookupError:
            return
        try:
            proc.wait(timeout=grace)
            return
        except subprocess.TimeoutExpired:
            continue


def run_part(part: int, args, out: str) -> bool:
    """Runs one part; True when every step that ran exited 0."""
    log_path, summary_path = (os.path.join(out, f"part{part}.{ext}") for ext in ("txt", "json"))
    summary = {"kind": "gpu_checklist", "part": part, "smoke": args.smoke,
               "date": datetime.datetime.now().isoformat(timespec="seconds"),
               "python": platform.python_version(), "host": platform.node(),
               "commit": _commit(), "budget_s": PART_BUDGET_S, "steps": []}
    start, ok = time.perf_counter(), True
    with open(log_path, "a") as log:
        for step in STEPS[part]:
            if args.only and step.name not in args.only:
                continue
            left = PART_BUDGET_S - (time.perf_counter() - start)
            timeout = min(args.timeout or step.timeout_s, left)
            cmd = step.command(args.smoke, out)
            if args.smoke and step.needs_gpu:
                record = {"name": step.name, "command": cmd, "skipped": "needs a GPU (--smoke)"}
            elif left < 5:
                record = {"name": step.name, "command": cmd,
                          "skipped": f"{left:.0f} s left of the part's {PART_BUDGET_S} s"}
            else:
                offset = log.tell()
                record = run_step(step, cmd, timeout, log)
                ok &= record["rc"] == 0
                with open(log_path) as f:  # the step's output on stdout too, as it runs
                    f.seek(offset)
                    sys.stdout.write(f.read())
                    sys.stdout.flush()
            if "skipped" in record:
                log.write(f"=== {step.name}: skipped, {record['skipped']}\n")
            summary["steps"].append(record)
            _write_json(summary_path, summary)
    return ok


def _commit():
    try:
        return subprocess.run(["git", "rev-parse", "--short", "HEAD"], capture_output=True,
                              text=True, cwd=ROOT, timeout=10).stdout.strip() or None
    except (OSError, subprocess.TimeoutExpired):
        return None


def _write_json(path, obj):
    tmp = path + ".tmp"
    with open(tmp, "w") as f:
        json.dump(obj, f, indent=1)
    os.replace(tmp, path)


def main(argv=None) -> int:
    args = parse_args(argv)
    out = os.path.abspath(os.environ.get("OUT") or args.out)
    os.makedirs(out, exist_ok=True)
    ok = True
    for part in args.parts:
        print(f"##### part {part} -> {out}", flush=True)
        ok &= run_part(part, args, out)
        with open(os.path.join(out, f"part{part}.json")) as f:
            for s in json.load(f)["steps"]:
                status = (f"skipped ({s['skipped']})" if "skipped" in s else
                          f"exit {s['rc']}{' TIMED OUT' if s['timed_out'] else ''}, "
                          f"{s['seconds']} s of {s['timeout_s']:.0f}")
                print(f"  part {part}  {s['name']:<20} {status}")
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
