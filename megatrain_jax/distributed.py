"""Data parallel from the config: processes (`jax.distributed`), compute devices, each process's
rows of a batch. The engine's side (mesh, shardings, collectives) is engine/parallel.py.

    distributed.initialize(cfg.distributed)        # first, before anything touches a device
    devices, host = distributed.devices(cfg.distributed)
    engine = build_engine(cfg, compute_devices=devices, host_device=host)

A step's global batch is data.batch_size rows per micro-batch; process p reads only its
1 / num_processes of each micro-batch's rows (`share`), and its devices split those again.
"""

import os
import sys
import threading
import time

import jax
import numpy as np

from megatrain_jax.config import ConfigError, DistributedConfig


def is_multiprocess(d: DistributedConfig) -> bool:
    return d.coordinator == "auto" or d.num_processes > 1


def initialize(d: DistributedConfig):
    """Joins the run's processes (a no-op for one process). Must come before any device is used.
    An unreachable coordinator is a ConfigError after distributed.timeout_s."""
    _cpu_devices(d)
    if not is_multiprocess(d) or jax.distributed.is_initialized():
        return
    # Collectives between CPU processes go through gloo (TCP); GPUs use NCCL whatever this says.
    jax.config.update("jax_cpu_collectives_implementation", "gloo")
    # A lost process then fails the others' next collective with an error this run can name
    # (lost_processes), instead of JAX's coordination client aborting them with a C++ fatal log.
    # (A lost process 0, which serves the coordinator, still aborts the others at once: theirs;
    # scripts/launch.py then passes on its own line naming process 0, not their fatal logs.)
    jax.config.update("jax_enable_recoverability", True)
    kwargs = {} if d.coordinator == "auto" else dict(
        coordinator_address=d.coordinator, num_processes=d.num_processes, process_id=d.process_id)
    where = ("distributed.coordinator=auto: " if d.coordinator == "auto" else
             f"distributed.coordinator={d.coordinator} (process {d.process_id} of "
             f"{d.num_processes}): ")
    line = (f"error: {where}the processes did not all join within distributed.timeout_s="
            f"{d.timeout_s} s (is the coordinator's host:port reachable, and every process "
            f"started?)")
    # JAX's client aborts the process (a C++ fatal log, SIGABRT) when the others do not join in
    # time; this watchdog says so in one line first, and exits 2: nothing has been written yet.
    joined = threading.Event()

    def watchdog():
        if not joined.wait(d.timeout_s):
            print(line, file=sys.stderr, flush=True)
            os._exit(2)

    threading.Thread(target=watchdog, daemon=True, name="distributed-join").start()
    try:
        jax.distributed.initialize(**kwargs, initialization_timeout=d.timeout_s + 30,
                                   heartbeat_timeout_seconds=d.timeout_s)
    except (RuntimeError, ValueError) as e:  # XlaRuntimeError is a RuntimeError
        first = (str(e).strip().splitlines() or [type(e).__name__])[0][:300]
        raise ConfigError(f"{line[len('error: '):]}: {first}") from None
    finally:
        joined.set()


def _cpu_devices(d: DistributedConfig):
    """Data parallel on a CPU-only machine needs a CPU device per compute device and one for the
    host state: asked for here, before the backend starts, unless already set (XLA_FLAGS'
    --xla_force_host_platform_device_count or jax_num_cpu_devices). Harmless on a GPU machine."""
    if d.local_devices <= 1 and not is_multiprocess(d):
        return
    if (jax.config.jax_num_cpu_devices != -1
            or "xla_force_host_platform_device_count" in os.environ.get("XLA_FLAGS", "")):
        return
    try:
        jax.config.update("jax_num_cpu_devices", max(d.local_devices, 1) + 1)
    except RuntimeError:  # the backend has started: devices() says what is missing
        pass


def devices(d: DistributedConfig) -> tuple[list, jax.Device]:
    """(the compute devices of every process, in mesh order; this process's host device).

    Each process picks its own the same way: `distributed.local_devices` accelerators (0: all),
    the host state on its first CPU device. On a CPU-only machine one device computes and holds
    the state (as a single-device run always has); data parallel there takes the CPU devices
    after the first as compute devices, the first holding the host state."""
    cpu = jax.local_devices(backend="cpu")
    host = cpu[0]
    accelerator = jax.default_backend() != "cpu"
    data_parallel = d.local_devices > 1 or jax.process_count() > 1
    chosen = []
    for p in range(jax.process_count()):
        mine = [x for x in jax.devices() if x.process_index == p]
        if accelerator:
            n = d.local_devices or len(mine)
            pick = mine[:n]
        elif not data_parallel:
            n, pick = 1, mine[:1]
        else:
            n = d.local_devices or 1
            pick = mine[1:n + 1]
        if len(pick) < n:
            have = (f"{len(mine)} {mine[0].platform.upper()} devices" if accelerator else
                    f"{len(mine)} CPU devices and no accelerator (one holds the host state; "
                    f"XLA_FLAGS=--xla_force_host_platform_device_count={n + 1} gives {n + 1})")
            raise ConfigError(f"distributed.local_devices={d.local_devices}: process {p} has "
                              f"{have}")
        chosen += pick
    return chosen, host


def check_batch(batch_size: int, num_devices: int, num_processes: int):
    """data.batch_size must split evenly over every compute device."""
    if batch_size % num_devices:
        raise ConfigError(f"data.batch_size={batch_size} does not split over the {num_devices} "
                          f"data-parallel devices ({num_processes} process(es) x "
                          f"{num_devices // num_processes} distributed.local_devices); make it a "
                          f"multiple of {num_devices}")


def share(batch: tuple, index: int, count: int) -> tuple:
    """Process `index` of `count`'s rows of every micro-batch: arrays (or pytrees of them) shaped
    (micro_batches, rows, ...), cut along rows (None stays None)."""
    def cut(x):
        rows = x.shape[1] // count
        return np.ascontiguousarray(x[:, index * rows:(index + 1) * rows])
    return tuple(None if part is None else jax.tree.map(cut, part) for part in batch)


def _client():
    from jax._src import distributed as jax_distributed  # the client has no public accessor
    return jax_distributed.global_state.client


def finish(d: DistributedConfig, wait_s: float = 600):
    """The end of a run with several processes: all of them meet (up to `wait_s` for the slowest,
    e.g. process 0 writing the last checkpoint), then leave, process 0 (which serves the
    coordinator) last. With recoverability on (initialize) JAX no longer does this at exit, and a
    process still leaving when the coordinator is gone is aborted by JAX's client."""
    if jax.process_count() == 1 or not jax.distributed.is_initialized():
        return
    client = _client()
    client.wait_at_barrier("megatrain_jax_finish", int(wait_s * 1000))
    if jax.process_index() != 0:
        jax.distributed.shutdown()
        return
    everyone = list(range(jax.process_count()))  # the asking task must be among those asked
    deadline = time.time() + d.timeout_s
    while time.time() < deadline:
        try:  # returns once every other process has left (or asks too)
            if set(client.get_live_nodes(everyone)) == {0}:
                break
        except Exception:
            break
        time.sleep(0.05)
    jax.distributed.shutdown()


def lost_processes() -> list[int]:
    """The processes of the run that the coordinator no longer sees alive ([] for one process,
    or when it cannot say)."""
    if jax.process_count() == 1:
        return []
    try:
        live = _client().get_live_nodes(list(range(jax.process_count())))
    except Exception:  # the coordinator itself is gone
        return [0]
    return [p for p in range(jax.process_count()) if p not in live]


def lost_line(e: BaseException, step: int) -> str | None:
    """After step `step` raised `e`: the one-line error naming the lost processes, or None when
    every process is alive (the error is not a lost process's)."""
    lost = lost_processes()
    if not lost:
        return None
    names = ", ".join(map(str, lost))
    cause = (str(e).strip().splitlines() or [type(e).__name__])[0][:200]
    return (f"lost process {names} of {jax.process_count()} at step {step} (it stopped answering; "
            f"this process's collective failed: {cause}); stopping. The last complete checkpoint "
            f"is intact: run the same command again to resume")
