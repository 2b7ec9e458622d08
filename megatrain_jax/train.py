"""`train(config)`: the Llama-family model on the streamed engine, with a plain loop: a step, then
what follows it, each at its cadence (`if step % n == 0`), in the order of the run's lines and
files (the pieces: megatrain_jax/after_step.py). What the config builds (the engine, the
optimizer, the data) is megatrain_jax/recipes.py's.

scripts/train.py and `megatrain train` (megatrain_jax.commands) are a thin CLI over this module.
"""

import contextlib
import dataclasses
import math
import os
import signal
import threading
import time

import jax
import numpy as np
import yaml

from megatrain_jax import advice, checkpoint, dpo
from megatrain_jax import after_step
from megatrain_jax import distributed
from megatrain_jax import fingerprint
from megatrain_jax import hostmem
from megatrain_jax import metrics_log
from megatrain_jax import flops
from megatrain_jax import machines
from megatrain_jax import plan as plan_lib
from megatrain_jax import progress
from megatrain_jax.config import Config, ConfigError, resume_changes, to_dict
from megatrain_jax.engine import tier as tier_lib
from megatrain_jax.errors import TrainingError
from megatrain_jax.after_step import ADVICE_AFTER, Run, tier_fault
from megatrain_jax.recipes import build_engine, build_schedule, load_data
from megatrain_jax.runlock import RunLock
from megatrain_jax.sources import files as source_files
from megatrain_jax.spikes import Spikes


def prepare_run_dir(run_dir: str):
    """Creates run_dir, or raises ConfigError naming it if it cannot be written."""
    try:
        os.makedirs(run_dir, exist_ok=True)
    except OSError as e:
        raise ConfigError(f"run_dir {run_dir!r} is not writable ({e.strerror})") from None
    if not os.access(run_dir, os.W_OK):
        raise ConfigError(f"run_dir {run_dir!r} is not writable")


class _StopSignals:
    """SIGTERM/SIGINT while training: the first asks to stop after the current step (the loop then
    saves a checkpoint and returns); a second exits at once. Orbax commits a checkpoint by renaming
    its directory when complete, so exiting mid-save leaves the earlier checkpoints as they were."""

    SIGNALS = (signal.SIGTERM, signal.SIGINT)

    def __init__(self):
        self.received = None
        self._previous = {}

    def _handle(self, signum, frame):
        if self.received is not None:
            os._exit(128 + signum)  # the shell's code for "killed by this signal"
        self.received = signal.Signals(signum).name

    def __enter__(self):
        if threading.current_thread() is threading.main_thread():  # Python's rule for handlers
            self._previous = {s: signal.signal(s, self._handle) for s in self.SIGNALS}
        return self

    def __exit__(self, *exc):
        for s, handler in self._previous.items():
            signal.signal(s, handler)


def resume_point(cfg: Config, log=print, data_identity=None) -> int | None:
    """The checkpoint step this run resumes from (None: a fresh run), after checking it can: it must
    be the latest (steps retrained past an older one would not replace the newer checkpoints, which
    are never overwritten), and its saved config must agree with cfg on every RESUME_KEYS key not in
    checkpoint.allow_changes, and its data files' identity must be data_identity's (default:
    the data as it is now). Reads only the checkpoint's meta; writes nothing."""
    directory = os.path.join(cfg.run_dir, "checkpoints")
    if not os.path.isdir(directory):
        if cfg.checkpoint.resume_step >= 0:
            raise checkpoint.CheckpointError(f"checkpoint.resume_step={cfg.checkpoint.resume_step}"
                                             f": no checkpoints directory {directory}")
        return None
    reader = checkpoint.make_manager(directory)
    try:
        step = checkpoint.resolve_step(reader, None if cfg.checkpoint.resume_step < 0
                                       else cfg.checkpoint.resume_step)
        if step is None:
            return None
        newer = [s for s in reader.all_steps() if s > step]
        if newer:
            raise checkpoint.CheckpointError(
                f"checkpoint.resume_step={step}: {reader.directory} holds newer checkpoints (steps "
                f"{', '.join(map(str, newer))}), which the retrained steps would not replace (a "
                f"checkpoint is never overwritten or deleted); move them out of it and run again")
        meta, _ = checkpoint.read_meta(reader, step)
    finally:
        reader.close()
    where = f"checkpoint step {step} in {reader.directory}"
    for key, old, new in resume_changes(meta.get("config") or {}, cfg):
        if not any(key == a or key.startswith(a + ".") for a in cfg.checkpoint.allow_changes):
            raise checkpoint.CheckpointError(
                f"{where} does not match this config: config.{key} is {old!r} in the checkpoint, "
                f"{new!r} now; to resume with the new value, add checkpoint.allow_changes=[{key}]")
        log(f"resuming with a changed {key}: {old!r} in {where}, {new!r} now "
            f"(checkpoint.allow_changes)")
    now = data_identity or fingerprint.files_identity(source_files.data_files(cfg.data))
    change = ("data_files" in meta and  # older checkpoints did not record their data
              fingerprint.first_change(meta["data_files"], now))
    if change:
        key = "data.sources" if cfg.data.sources else "data.path"
        if not {key, "data.path", "data"} & set(cfg.checkpoint.allow_changes):
            raise checkpoint.CheckpointError(
                f"{where} was trained on other data: {change}; to resume with the data as it is "
                f"now, add checkpoint.allow_changes=[{key}]")
        log(f"resuming with changed data: {change} (checkpoint.allow_changes)")
    return step


def train(cfg: Config, *, log=print, console=None) -> list[dict]:
    """Trains up to cfg.train.steps (the total) steps; returns the per-step metrics it logged.

    `log` takes the run's lines: a line per `train.log_every` steps (progress.line), evaluations,
    checkpoints. `console`, a rich Console, adds a live progress bar under them (the command line
    passes one when stdout is a terminal).

    Resumes from the latest complete checkpoint in `<run_dir>/checkpoints` (or the step
    `checkpoint.resume_step`) when there is one. Saves every `checkpoint.every` steps, at the last
    step, and on SIGTERM/SIGINT (then returns early). Holds `<run_dir>/train.lock` throughout.

    Data parallel (cfg.distributed, megatrain_jax/distributed.py): every process runs this with
    its own distributed.process_id; process 0 alone logs, writes the run's files and saves."""
    if cfg.distributed.process_id == 0:  # a busy run_dir refused before the others join
        RunLock(cfg.run_dir).check_free()  # (process 0 refusing later would abort them)
    distributed.initialize(cfg.distributed)  # before anything touches a device
    devices, host_device = distributed.devices(cfg.distributed)
    distributed.check_batch(cfg.data.batch_size, len(devices), jax.process_count())
    if cfg.data.format == "preference" and len(devices) > 1:
        raise ConfigError(f"data.format=preference is not data parallel yet ({len(devices)} "
                          f"devices from distributed.local_devices/num_processes); run it on one")
    quiet = jax.process_index() != 0
    # validate all inputs before anything is written (a token cache is built here, outside run_dir)
    dataset, eval_set = load_data(cfg, log=(lambda *a, **k: None) if quiet else log)
    me, processes = jax.process_index(), jax.process_count()
    dataset.share = (me, processes)  # this process reads its rows of every batch, no more
    if eval_set:
        eval_set = [distributed.share(batch, me, processes) for batch in eval_set]
    placed = dict(compute_devices=devices, host_device=host_device)
    if me != 0:  # the others train alongside, quietly, writing nothing
        history = _train_locked(cfg, dataset, eval_set, lambda *a, **k: None, None, placed)
        distributed.finish(cfg.distributed)
        return history
    metrics_log.check(cfg)
    try:  # freed layer-sized buffers go back to the kernel: ~22 -> ~14 B/param of RSS, see
        hostmem.set_mmap_threshold(1 << 20)  # docs/benchmarks.md "Host memory per parameter"
    except OSError:  # not glibc: nothing to tune
        pass
    if hostmem.huge_pages_on():  # the training commands' (hostmem.with_huge_pages)
        log(f"host memory: glibc's allocations on transparent huge pages ({hostmem.TUNABLE}; "
            f"{hostmem.OPT_OUT}=0 runs without)")
    created = not os.path.exists(cfg.run_dir)
    prepare_run_dir(cfg.run_dir)
    try:
        with RunLock(cfg.run_dir, log=log):
            history = _train_locked(cfg, dataset, eval_set, log, console, placed)
        distributed.finish(cfg.distributed)  # every process ends together
        return history
    except BaseException:
        if created:  # refused before writing anything (a first step out of memory too): no trace
            for directory in (os.path.join(cfg.run_dir, "checkpoints"), cfg.run_dir):
                if os.path.isdir(directory) and not os.listdir(directory):
                    os.rmdir(directory)
        raise


def _is_out_of_memory(e: BaseException) -> bool:
    text = str(e)
    return isinstance(e, MemoryError) or "RESOURCE_EXHAUSTED" in text or "Out of memory" in text


def _out_of_memory_line(e: BaseException, step: int, run_plan) -> str:
    asked = str(e).strip().splitlines()[0] if str(e).strip() else type(e).__name__
    return (f"out of memory at step {step} ({asked[:200]}); the plan predicted a device peak of "
            f"{run_plan.device_peak / 1e9:.2f} GB of {run_plan.machine.device_memory_gb:.2f} GB and "
            f"{run_plan.host_total / 1e9:.2f} GB of {run_plan.machine.host_memory_gb:.2f} GB host "
            f"RAM; lower data.seq_len, data.batch_size or train.tile_size, or set "
            f"train.offload_activations=true (python scripts/plan.py shows what fits)")


def _raise_if_lost(e: BaseException, step: int):
    """With several processes: a step that failed because another process is gone is a
    TrainingError naming it (exit 1)."""
    if jax.process_count() > 1:
        line = distributed.lost_line(e, step)
        if line:
            raise TrainingError(line) from None


def _peak_flops(cfg: Config, device) -> tuple[float | None, str]:
    """(the bf16 dense peak FLOP/s that MFU is measured against, or None, and where it is from)."""
    if cfg.logging.peak_tflops:
        return (cfg.logging.peak_tflops * 1e12,
                f"MFU against logging.peak_tflops={cfg.logging.peak_tflops:g}")
    tflops = machines.peak_bf16_tflops(device.device_kind)
    if tflops is None:
        return None, f"no MFU: {device.device_kind} has no known peak (set logging.peak_tflops)"
    return tflops * 1e12, f"MFU against {tflops:g} bf16 TFLOPS ({device.device_kind})"


def _train_locked(cfg: Config, dataset, eval_set, log, console, placed) -> list[dict]:
    identity = fingerprint.files_identity(source_files.data_files(cfg.data))  # read once
    resume_step = resume_point(cfg, log, identity)
    ckpt_dir = os.path.join(cfg.run_dir, "checkpoints")
    if os.path.isdir(ckpt_dir):  # else run_dir was just checked; make_manager creates it
        checkpoint.check_writable(ckpt_dir)  # before training, not at the first save
    devices = len(placed["compute_devices"])
    run_plan = _checked_plan(cfg, devices)
    engine = build_engine(cfg, offload_activations=run_plan.offload_activations,
                          execution=run_plan.execution, bus=run_plan.bus, **placed)
    manager = None
    with _closed_after(lambda: manager, engine):
        ckpt = cfg.checkpoint
        manager = checkpoint.make_manager(  # sharded: each process saves its rows
            ckpt_dir, keep=ckpt.keep, async_save=ckpt.async_save,
            write_bytes=checkpoint.largest_unit_bytes(engine), sharded=engine.shards is not None)
        if cfg.data.format == "preference":  # the starting weights', before any checkpoint's
            dpo.prepare_reference(cfg, engine, dataset, log)
        start, saved_progress = 0, {}
        if resume_step is not None:
            # The saved shapes are checked against the engine's before anything is loaded.
            meta = checkpoint.restore(manager, engine, resume_step)
            dataset.restore(meta["data_state"])
            start, saved_progress = meta["step"], meta.get("progress", {})
        # Older checkpoints did not record the updates: their steps, as if none had been skipped.
        run = Run(cfg, engine, dataset, eval_set, manager, run_plan, start,
                  saved_progress.get("updates", start), identity,
                  Spikes(manager, saved_progress, start if resume_step is not None else None), log,
                  primary=jax.process_index() == 0)
        peak_flops = _log_start(run, devices)
        history = _loop(run, console, peak_flops=peak_flops,
                        loss_smooth=saved_progress.get("loss_smooth"))
        if cfg.data.sources:
            log(dataset.report())  # the tokens each source of the mixture gave
    if start >= cfg.train.steps:
        log(f"nothing to do: checkpoint step {start} reached train.steps={cfg.train.steps}")
    return history


@contextlib.contextmanager
def _closed_after(manager, engine):
    """Closes the checkpoint manager (`manager()`: None until made) and the engine after the
    block, also when it raises: its pending saves and host updates finish, its threads and the
    disk tier's files go. A close that fails then is not the error to report: the block's is."""
    try:
        yield
    except BaseException:
        for close in (lambda: manager() and manager().close(), engine.close):
            try:
                close()
            except Exception:  # the block's error is the one to report
                pass
        raise
    if manager() is not None:
        manager().close()
    engine.close()


def _checked_plan(cfg: Config, devices: int):
    """The memory plan, before anything is allocated: a run that cannot fit stops here, as does
    a disk tier without room. Planned for one device's rows: data parallel splits each
    micro-batch over the devices."""
    per_device = dataclasses.replace(cfg, data=dataclasses.replace(
        cfg.data, batch_size=cfg.data.batch_size // devices))
    run_plan = plan_lib.plan(per_device, machines.machine_from_device(jax.local_devices()[0]))
    if not run_plan.fits and not cfg.train.ignore_plan:
        raise ConfigError(f"this config does not fit: {' '.join(run_plan.summary().split())} "
                          f"(python scripts/plan.py --config ... shows what would; "
                          f"train.ignore_plan=true runs it anyway)")
    if cfg.offload.tier == "disk":  # the engine checks its exact bytes again, before writing
        try:
            tier_lib.check_writable(cfg.offload.path)
            tier_lib.check_space(cfg.offload.path, run_plan.disk_bytes)
        except tier_lib.TierError as e:
            raise ConfigError(str(e)) from None
    return run_plan


def _log_start(run: Run, devices: int) -> float | None:
    """The run's first lines: its config, model, plan, disk tier, data, evaluation and resume.
    Returns the peak FLOP/s of all its devices, which MFU is measured against (None: unknown)."""
    cfg, engine, dataset, log = run.cfg, run.engine, run.dataset, run.log
    log(yaml.safe_dump(to_dict(cfg), sort_keys=False).rstrip())
    peak_flops, peak_source = _peak_flops(cfg, engine.compute_device)
    log(f"model: {cfg.model.num_params() / 1e6:.2f}M params, {cfg.model.num_layers} layers | "
        f"{dataset.tokens_per_batch} tokens/step | compute {engine.compute_device.platform}"
        f"{_data_parallel_note(devices)} | {peak_source}")
    log(run.plan.summary())
    if not run.plan.fits:
        log("plan: overridden by train.ignore_plan=true: running a config the plan says does not "
            "fit (an out-of-memory error names the step)")
    if engine.disk_tier is not None:
        tier = engine.disk_tier
        log(f"disk tier: {tier.total_bytes / 1e9:.2f} GB in {tier.path} ({tier.opened}), "
            f"read ahead {cfg.offload.read_ahead} layers, {tier.io_mode}")
    log(dataset.summary)  # the data's tokens; for sft/preference, what was truncated, skipped
    if run.eval_set:
        when = (f"every {cfg.train.eval_every} steps and at the end" if cfg.train.eval_every
                else "at the end")
        log(f"eval: {len(run.eval_set)} batches of {dataset.tokens_per_batch} tokens from "
            f"{_eval_source(cfg)}, {when}")
    if run.start:
        log(f"resumed from checkpoint step {run.start} ({run.manager.directory})")
    return None if peak_flops is None else peak_flops * devices  # MFU of every device's peak


def _loop(run: Run, console, *, peak_flops, loss_smooth) -> list[dict]:
    """Steps start + 1 to train.steps, each followed by what comes after it, in the order of the
    run's lines and files. A step's loss and gradient norm are read once the next step is
    dispatched (its record written, its line logged then), so the device never waits for that
    read; a step after which the weights are read or the run may end (an evaluation, a
    checkpoint, the last step, a stop signal) and the first ADVICE_AFTER (the advice times them)
    are read before the next is dispatched. A stop signal ends the run after the step it came
    in, with a checkpoint of that step. Returns the records."""
    cfg, engine, log, total = run.cfg, run.engine, run.log, run.cfg.train.steps
    lrs, meter = _rates(run, peak_flops, loss_smooth)
    with _StopSignals() as stop, contextlib.ExitStack() as files:
        metrics = after_step.Metrics(run, meter=meter, files=files, live=_live(run, console, files))
        reads, pending = _Reads(run, lrs, metrics), None  # pending: dispatched, not yet read
        for step in range(run.start + 1, total + 1):
            last = step == total
            dispatched = _dispatch(run, step)
            if pending is not None:  # the step before, read while this one runs
                reads.write(*reads.read(pending))
            evaluating = run.eval_set and (last or _every(step, cfg.train.eval_every))
            saving = last or _every(step, cfg.checkpoint.every)
            if not (evaluating or saving or stop.received or step <= run.start + ADVICE_AFTER):
                pending = dispatched
                continue
            pending, (record, nonfinite) = None, reads.read(dispatched)
            if evaluating:  # the weights after this step's update, in this step's record
                record.update(after_step.evaluate(engine, run.eval_set))
            reads.write(record, nonfinite, evaluating)
            if saving or stop.received:
                after_step.save_checkpoint(run, step, meter)
            if stop.received:
                log(after_step.stop_line(run, step, stop.received))
                break
        checkpoint.wait(run.manager)  # inside: a second signal still exits at once
    if run.spikes.spiking:
        log(f"the run ended in a loss spike: {run.spikes.advice()}")
    return metrics.history


class _Reads:
    """A run's steps read in order: each step's record made from its outputs (_record), then
    written and logged; the engine's counters after the first step and the next steps' times,
    which the advice reads."""

    def __init__(self, run: Run, lrs, metrics):
        self.run, self.lrs, self.metrics = run, lrs, metrics
        self.read_at, self.counted, self.timed = None, None, []

    def read(self, dispatched) -> tuple:
        """(the record of a step `_dispatch` returned, where its gradient was not finite)."""
        run = self.run
        record, self.read_at, nonfinite = _record(run, *dispatched, self.lrs, self.read_at)
        step = record["step"]
        if step == run.start + 1:  # the first step compiles: the advice times the next ones
            self.counted = dataclasses.replace(run.engine.counters)
        elif step <= run.start + ADVICE_AFTER:
            self.timed.append(record["step_time_s"])
        self.metrics.open()
        return record, nonfinite

    def write(self, record: dict, nonfinite: list, evaluating: bool = False):
        run, step, total = self.run, record["step"], self.run.cfg.train.steps
        self.metrics.write(record)
        if run.bad_steps:
            after_step.skipped(run, step, nonfinite)
        elif step == total or _every(step, run.cfg.train.log_every):
            run.log(progress.line(record, total_steps=total))
        spike = run.spikes.observe(step, record["loss"], updated=not run.bad_steps)
        if spike:
            run.log(spike)
        if step == run.start + ADVICE_AFTER:
            for line in advice.for_run(run.cfg, run.engine, run.plan.machine, self.counted,
                                       self.timed):
                run.log(line)
        if evaluating:
            run.log(after_step.eval_line(record))


def _every(step: int, n: int) -> bool:
    """Step `step` is one of every n-th (n 0: none)."""
    return n > 0 and step % n == 0


def _rates(run: Run, peak_flops, loss_smooth) -> tuple:
    """(each step's learning rate, for the log; the progress.Meter of the run's figures)."""
    cfg, total = run.cfg, run.cfg.train.steps
    with jax.default_device(jax.local_devices(backend="cpu")[0]):
        lrs = np.asarray(build_schedule(cfg.optimizer, total)(np.arange(total)))
    meter = progress.Meter(total_steps=total, start_step=run.start,
                           tokens_per_step=run.dataset.tokens_per_batch,
                           flops_per_token=flops.flops_per_token(cfg.model, cfg.data.seq_len),
                           peak_flops=peak_flops, device=run.engine.compute_device,
                           smoothing=loss_smooth)
    return lrs, meter


def _live(run: Run, console, files):
    """The live progress bar under the lines, on a terminal (rich), else None."""
    if console is None or not console.is_terminal or run.start >= run.cfg.train.steps:
        return None
    return files.enter_context(progress.LiveDisplay(console, total_steps=run.cfg.train.steps,
                                                    start_step=run.start))


def _dispatch(run: Run, step: int) -> tuple:
    """(step, the engine's outputs, its units' sums of squares, when it started): step `step`
    dispatched, not read."""
    inputs, targets, context = run.dataset.next_batch_with_context()
    t0 = time.perf_counter()
    with _faults(run, step):
        out = run.engine.train_step(inputs, targets, context)
    return step, out, run.engine.unit_sq, t0


def _record(run: Run, step: int, out: dict, unit_sq, started: float, lrs,
            read_before) -> tuple:
    """(step `step`'s record: its loss, gradient norm, time and learning rate; when it was read;
    where its gradient was not finite, [] if it was): its outputs `out` read (the sync point),
    the run's counts updated: a step with a non-finite gradient is skipped and applies no update.
    Its time runs from its start, or from the step before's read where that came later (the
    steps overlapped)."""
    with _faults(run, step):
        loss, grad_norm = float(out["loss"]), float(out["grad_norm"])
    read = time.perf_counter()
    dt = read - max(started, read_before or started)
    record = {"step": step, "loss": loss, "grad_norm": grad_norm,
              "tokens_per_sec": run.dataset.tokens_per_batch / dt, "step_time_s": dt,
              "lr": float(lrs[run.updates])}  # the rate this step's update uses
    if "aux_loss" in out:  # a mixture of experts' load balancing, included in loss
        record["aux_loss"] = float(out["aux_loss"])
    if "stats" in out:  # the DPO head's: reward margin and accuracy, log-probs
        record.update(dpo.step_metrics(out["stats"]))
    run.bad_steps = 0 if math.isfinite(grad_norm) else run.bad_steps + 1
    if run.bad_steps:
        record["skipped"] = True
    else:
        run.updates += 1
    return record, read, run.engine.nonfinite_units(unit_sq) if run.bad_steps else []


@contextlib.contextmanager
def _faults(run: Run, step: int):
    """A fault of step `step` (its dispatch or its read) as one line naming the step where it
    has one (out of memory, a lost process, the disk tier)."""
    try:
        yield
    except (jax.errors.JaxRuntimeError, MemoryError) as e:
        if _is_out_of_memory(e):
            raise ConfigError(_out_of_memory_line(e, step, run.plan)) from None
        _raise_if_lost(e, step)
        raise
    except tier_lib.TierError as e:  # e.g. the disk of offload.path filled mid-run
        raise tier_fault(e, step, run.manager) from None
    except (RuntimeError, ValueError) as e:  # gloo's failed collective is a ValueError
        _raise_if_lost(e, step)
        raise


def _data_parallel_note(devices: int) -> str:
    if devices == 1:
        return ""
    return (f" x {devices} (data parallel: {jax.process_count()} process(es) x "
            f"{devices // jax.process_count()} devices)")


def _eval_source(cfg: Config) -> str:
    if cfg.data.eval_path:
        return cfg.data.eval_path
    return f"the last {cfg.data.eval_fraction:g} of {cfg.data.path} (data.eval_fraction)"
