"""What the training loop does after each step besides the step, each at its own cadence
(levanter's trainer hooks): the run's files and metrics, the step lines, evaluation, the advice
after the first steps, checkpoints. train.py's loop makes a StepInfo per step and calls its hooks
in order; a Hook runs its function when its cadence says so:

    Hook(lines.progress, every=cfg.train.log_every, at_end=True)   # a line every log_every steps
    Hook(checkpoints.save, every=cfg.checkpoint.every, at_end=True, on_stop=True)
"""

import dataclasses
import json
import math
import os
from typing import Callable

import yaml

from megatrain_jax import advice, checkpoint, metrics_log, progress
from megatrain_jax.config import Config, to_dict
from megatrain_jax.engine import tier as tier_lib
from megatrain_jax.errors import TrainingError

ADVICE_AFTER = 3  # steps into a run: the first compiles, the next two are measured


@dataclasses.dataclass
class StepInfo:
    """A step as its hooks see it. `record` is its metrics line: hooks before Metrics.write add
    to it (evaluation), hooks after it read it."""
    step: int
    last: bool  # the run's last step (train.steps)
    record: dict
    bad_steps: int  # consecutive steps with a non-finite gradient up to this one (0: it updated)
    updates: int  # optimizer updates applied so far, this step's included
    stop: object  # the stop signals: `.received` names a signal that asks to stop, else None


@dataclasses.dataclass(frozen=True)
class Hook:
    """`run(info)` after every `every`-th step (0: none), after the last step when `at_end`,
    and after a step during which a stop signal came when `on_stop`."""
    run: Callable[[StepInfo], None]
    every: int = 1
    at_end: bool = False
    on_stop: bool = False

    def __call__(self, info: StepInfo):
        if ((self.every and info.step % self.every == 0) or (self.at_end and info.last)
                or (self.on_stop and info.stop.received)):
            self.run(info)


class Metrics:
    """metrics.jsonl, TensorBoard and W&B (metrics_log.Sinks) and the live display: each step's
    record with the Meter's figures; `history` keeps the records. `open` writes the run's files
    after its first step (a run refused before it writes nothing); only process 0 writes them."""

    def __init__(self, cfg: Config, *, start: int, meter: progress.Meter, files, live, log,
                 primary: bool):
        self.cfg, self.start, self.meter, self.files, self.live = cfg, start, meter, files, live
        self.log, self.primary = log, primary
        self.history, self._file, self._sinks = [], None, None

    def open(self, info: StepInfo):
        if self._file is not None:
            return
        path = os.path.join(self.cfg.run_dir, "metrics.jsonl")
        if self.primary:
            _write_config(self.cfg)
            _keep_metrics_through(path, self.start)
        self._file = self.files.enter_context(open(path if self.primary else os.devnull, "a"))
        self._sinks = (metrics_log.Sinks.open(self.cfg, self.start, self.log) if self.primary
                       else metrics_log.Sinks())  # TensorBoard, W&B
        self.files.push(_closing(self._sinks.close))

    def write(self, info: StepInfo):
        record = info.record
        record.update(self.meter.measure(info.step, record["loss"], record["step_time_s"]))
        if self.live is not None:
            self.live.update(record)
        self.history.append(record)
        self._file.write(_json_line(record))
        self._file.flush()
        self._sinks.write(record)


class StepLines:
    """The run's line for a step: a skipped step's (the run stops after train.max_bad_steps of
    them in a row), else progress.line every train.log_every steps."""

    def __init__(self, cfg: Config, engine, manager, log):
        self.cfg, self.engine, self.manager, self.log = cfg, engine, manager, log

    def skipped(self, info: StepInfo):
        if not info.bad_steps:
            return
        step, bad, limit = info.step, info.bad_steps, self.cfg.train.max_bad_steps
        where = ", ".join(map(str, self.engine.nonfinite_units())) or "the loss"
        self.log(f"step {step:5d} | non-finite gradient (in {where}): skipped, weights and "
                 f"optimizer state unchanged ({bad} of train.max_bad_steps={limit} in a row)")
        if bad >= limit:
            checkpoint.wait(self.manager)  # the last one written is complete before it is named
            raise TrainingError(
                f"stopped at step {step}: {bad} consecutive steps with a non-finite gradient "
                f"(train.max_bad_steps={limit}, last in {where}); no update and no checkpoint was "
                f"made from them; {resume_hint(self.manager)}")

    def progress(self, info: StepInfo):
        if not info.bad_steps:
            self.log(progress.line(info.record, total_steps=self.cfg.train.steps))


class Evaluation:
    """The held-out loss after a step (forward only: it reads the weights after the step's update
    and changes nothing): `run` adds eval_loss and eval_ppl to the record, `line` logs them."""

    def __init__(self, engine, batches, log):
        self.engine, self.batches, self.log = engine, batches, log

    def run(self, info: StepInfo):
        loss = evaluate(self.engine, self.batches)
        info.record["eval_loss"] = loss
        info.record["eval_ppl"] = math.exp(loss) if loss < 700 else math.inf

    def line(self, info: StepInfo):
        self.log(f"step {info.step:5d} | eval loss {info.record['eval_loss']:.4f} | "
                 f"ppl {info.record['eval_ppl']:.2f}")


def evaluate(engine, batches) -> float:
    """The mean loss per counted token over the eval batches [(inputs, targets, context)]."""
    outs = [engine.evaluate(x, t, c) for x, t, c in batches]  # dispatched, then read
    loss_sum = sum(float(o["loss_sum"]) for o in outs)
    weight = sum(float(o["weight"]) for o in outs)
    return loss_sum / weight if weight > 0 else math.nan


class Advice:
    """advice.for_run after step start + ADVICE_AFTER: `measure` snapshots the engine's counters
    after the first step (which compiles) and times the next ones, `report` logs the advice."""

    def __init__(self, cfg: Config, engine, machine, *, start: int, log):
        self.cfg, self.engine, self.machine, self.start, self.log = cfg, engine, machine, start, log
        self._counted, self._timed = None, []

    def measure(self, info: StepInfo):
        if info.step == self.start + 1:
            self._counted = dataclasses.replace(self.engine.counters)
        elif info.step <= self.start + ADVICE_AFTER:
            self._timed.append(info.record["step_time_s"])

    def report(self, info: StepInfo):
        if info.step == self.start + ADVICE_AFTER:
            for line in advice.for_run(self.cfg, self.engine, self.machine, self._counted,
                                       self._timed):
                self.log(line)


class Checkpoints:
    """A checkpoint of the engine's state with the data's position, the data files' identity and
    the run's progress (updates applied, the smoothed loss). Process 0 saves replicated host
    state; with sharded host state every process saves its rows."""

    def __init__(self, cfg: Config, engine, dataset, manager, *, meter: progress.Meter,
                 identity: dict, log, primary: bool):
        self.cfg, self.engine, self.dataset, self.manager = cfg, engine, dataset, manager
        self.meter, self.identity, self.log = meter, identity, log
        self.saves = primary or engine.shards is not None

    def save(self, info: StepInfo):
        step, manager = info.step, self.manager
        if not self.saves:
            return
        if info.bad_steps:  # its state is an earlier step's: saved, it would rotate that out
            self.log(f"step {step:5d} | skipped: no checkpoint ({_last_checkpoint(manager)})")
        elif step in manager.all_steps():  # only after resume_step: never overwrite one
            self.log(f"checkpoint step {step} already exists in {manager.directory}; kept as is")
        else:
            try:  # the state is read back from the disk tier's files, which may fail
                checkpoint.save(manager, step, self.engine, {
                    "config": to_dict(self.cfg), "data_state": self.dataset.state(),
                    "data_files": self.identity,
                    "progress": {"updates": info.updates, "loss_smooth": self.meter.smoothing()},
                    "rng": {"seed": self.cfg.train.seed}})  # the home of a future dropout key
            except tier_lib.TierError as e:
                raise tier_fault(e, step, manager) from None

    def stop_line(self, info: StepInfo) -> str:
        """The line of a run a stop signal ends after this step."""
        if info.bad_steps:
            return (f"{info.stop.received} received: stopped after step {info.step}, skipped; "
                    f"{resume_hint(self.manager)}")
        return (f"{info.stop.received} received: stopped after step {info.step} with a "
                f"checkpoint; run the same command again to resume")


def tier_fault(e: tier_lib.TierError, step: int, manager) -> TrainingError:
    """The disk tier failed at step `step` (its files are scratch: the checkpoints hold the run)."""
    return TrainingError(f"stopped at step {step}: {e}; {checkpoint.completed(manager)}; run the "
                         f"same command again to resume")


def _last_checkpoint(manager) -> str:
    step = manager.latest_step()
    if step is None:
        return f"none written yet in {manager.directory}"
    return f"the last is step {step} in {manager.directory}"


def resume_hint(manager) -> str:
    """Where the run can go on from after non-finite steps, and how."""
    step = manager.latest_step()
    if step is None:
        return ("no checkpoint was written before them: start again with a lower "
                "optimizer.learning_rate, or check the data")
    return (f"the last checkpoint written before them is step {step} in {manager.directory}; "
            f"to resume from it, run again with a lower optimizer.learning_rate and "
            f"checkpoint.allow_changes=[optimizer] (or check the data)")


def _keep_metrics_through(path: str, step: int):
    """Drops the records after `step` (logged after the checkpoint a run resumes from, or a torn
    last line), so a resumed run appends each step once. Atomic: a temp file, then os.replace."""
    if not os.path.exists(path):
        return
    with open(path) as f:
        lines = f.readlines()
    kept = []
    for line in lines:
        try:
            if line.endswith("\n") and json.loads(line)["step"] <= step:
                kept.append(line)
        except (ValueError, KeyError, TypeError):
            pass
    if kept != lines:
        with open(path + ".tmp", "w") as f:
            f.writelines(kept)
        os.replace(path + ".tmp", path)


def _write_config(cfg: Config):
    path = os.path.join(cfg.run_dir, "config.yaml")
    with open(path + ".tmp", "w") as f:  # a full disk leaves the old one whole
        yaml.safe_dump(to_dict(cfg), f, sort_keys=False)
    os.replace(path + ".tmp", path)


def _json_line(record: dict) -> str:
    """A metrics.jsonl line: strict JSON, so a non-finite number (a skipped step's grad_norm, an
    infinite perplexity) is null."""
    finite = {k: None if isinstance(v, float) and not math.isfinite(v) else v
              for k, v in record.items()}
    return json.dumps(finite) + "\n"


def _closing(close):
    """An ExitStack exit for close(): a close that fails while an error is on its way out (a full
    disk fails TensorBoard's flush too) leaves that error, which names the step and the
    checkpoints, in place."""
    def exit_(exc_type, exc, tb):
        try:
            close()
        except Exception:
            if exc is None:
                raise
        return False
    return exit_
