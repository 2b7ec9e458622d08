"""What the training loop does after a step besides the step, as small functions that train.py's
loop calls in the order of the run's lines and files: the run's files and metrics (Metrics), the
line of a skipped step, evaluation, a checkpoint, the line of a stop. What a loop works with is a
Run; the loss spikes it watches are megatrain_jax/spikes.py's.
"""

import dataclasses
import json
import math
import os
from typing import Callable

import yaml

from megatrain_jax import checkpoint, metrics_log, progress
from megatrain_jax.config import Config, to_dict
from megatrain_jax.engine import tier as tier_lib
from megatrain_jax.errors import TrainingError
from megatrain_jax.spikes import Spikes

ADVICE_AFTER = 3  # steps into a run: the first compiles, the next two are measured


@dataclasses.dataclass
class Run:
    """What a run's loop works with (train._train_locked builds it)."""
    cfg: Config
    engine: object  # the StreamedEngine
    dataset: object
    eval_set: list | None
    manager: object  # the checkpoints' (checkpoint.make_manager)
    plan: object  # plan_lib.plan's, for this process's devices
    start: int  # the checkpoint step it resumed from (0: none)
    updates: int  # updates applied so far: the count the schedule reads (none on a skipped step)
    identity: dict  # the data files' (fingerprint.files_identity), read once
    spikes: Spikes  # the losses it judges against, the checkpoint it keeps from before a spike
    log: Callable
    primary: bool  # process 0: it logs and writes the run's files
    bad_steps: int = 0  # consecutive steps with a non-finite gradient


class Metrics:
    """metrics.jsonl, TensorBoard and W&B (metrics_log.Sinks) and the live display: each step's
    record with the Meter's figures; `history` keeps the records. `open` writes the run's files
    (after the first step: a run refused before it writes nothing); only process 0 writes them."""

    def __init__(self, run: Run, *, meter: progress.Meter, files, live):
        self.run, self.meter, self.files, self.live = run, meter, files, live
        self.history, self._file, self._sinks = [], None, None

    def open(self):
        if self._file is not None:
            return
        cfg, start, primary = self.run.cfg, self.run.start, self.run.primary
        path = os.path.join(cfg.run_dir, "metrics.jsonl")
        if primary:
            _write_config(cfg)
            _keep_metrics_through(path, start)
        self._file = self.files.enter_context(open(path if primary else os.devnull, "a"))
        self._sinks = (metrics_log.Sinks.open(cfg, start, self.run.log) if primary
                       else metrics_log.Sinks())  # TensorBoard, W&B
        self.files.push(_closing(self._sinks.close))

    def write(self, record: dict):
        record.update(self.meter.measure(record["step"], record["loss"], record["step_time_s"]))
        if self.live is not None:
            self.live.update(record)
        self.history.append(record)
        self._file.write(_json_line(record))
        self._file.flush()
        self._sinks.write(record)


def skipped(run: Run, step: int, nonfinite: list):
    """The line of a step with a non-finite gradient (in the units `nonfinite`, the engine's
    nonfinite_units of it); the run stops after train.max_bad_steps of them in a row
    (TrainingError)."""
    bad, limit = run.bad_steps, run.cfg.train.max_bad_steps
    where = ", ".join(map(str, nonfinite)) or "the loss"
    run.log(f"step {step:5d} | non-finite gradient (in {where}): skipped, weights and optimizer "
            f"state unchanged ({bad} of train.max_bad_steps={limit} in a row)")
    if bad >= limit:
        checkpoint.wait(run.manager)  # the last one written is complete before it is named
        raise TrainingError(
            f"stopped at step {step}: {bad} consecutive steps with a non-finite gradient "
            f"(train.max_bad_steps={limit}, last in {where}); no update and no checkpoint was "
            f"made from them; {resume_hint(run)}")


def evaluate(engine, batches) -> dict:
    """The held-out loss at the weights after the step's update (forward only: it changes
    nothing), as the record's eval_loss and eval_ppl: the mean loss per counted token over the
    eval batches [(inputs, targets, context)]."""
    outs = [engine.evaluate(x, t, c) for x, t, c in batches]  # dispatched, then read
    loss_sum = sum(float(o["loss_sum"]) for o in outs)
    weight = sum(float(o["weight"]) for o in outs)
    loss = loss_sum / weight if weight > 0 else math.nan
    return {"eval_loss": loss, "eval_ppl": math.exp(loss) if loss < 700 else math.inf}


def eval_line(record: dict) -> str:
    return (f"step {record['step']:5d} | eval loss {record['eval_loss']:.4f} | "
            f"ppl {record['eval_ppl']:.2f}")


def save_checkpoint(run: Run, step: int, meter: progress.Meter):
    """A checkpoint of the engine's state with the data's position, the data files' identity and
    the run's progress (updates applied, the smoothed loss, what spikes judge against). Process 0
    saves replicated host state; with sharded host state every process saves its rows."""
    manager = run.manager
    if not (run.primary or run.engine.shards is not None):
        return
    if run.bad_steps:  # its state is an earlier step's: saved, it would rotate that out
        run.log(f"step {step:5d} | skipped: no checkpoint ({_last_checkpoint(manager)})")
    elif step in manager.all_steps():  # only after resume_step: never overwrite one
        run.log(f"checkpoint step {step} already exists in {manager.directory}; kept as is")
    else:
        try:  # the state is read back from the disk tier's files, which may fail
            checkpoint.save(manager, step, run.engine, {
                "config": to_dict(run.cfg), "data_state": run.dataset.state(),
                "data_files": run.identity,
                "progress": {"updates": run.updates, "loss_smooth": meter.smoothing(),
                             **run.spikes.state()},
                "rng": {"seed": run.cfg.train.seed}})  # the home of a future dropout key
        except tier_lib.TierError as e:
            raise tier_fault(e, step, manager) from None
        run.spikes.saved(step)


def stop_line(run: Run, step: int, signal: str) -> str:
    """The line of a run a stop signal ends after step `step`."""
    if run.bad_steps:
        return f"{signal} received: stopped after step {step}, skipped; {resume_hint(run)}"
    return (f"{signal} received: stopped after step {step} with a checkpoint; run the same "
            f"command again to resume")


def tier_fault(e: tier_lib.TierError, step: int, manager) -> TrainingError:
    """The disk tier failed at step `step` (its files are scratch: the checkpoints hold the run)."""
    return TrainingError(f"stopped at step {step}: {e}; {checkpoint.completed(manager)}; run the "
                         f"same command again to resume")


def _last_checkpoint(manager) -> str:
    step = manager.latest_step()
    if step is None:
        return f"none written yet in {manager.directory}"
    return f"the last is step {step} in {manager.directory}"


def resume_hint(run: Run) -> str:
    """Where the run can go on from after non-finite steps, and how: the last checkpoint when its
    weights gave a normal step, else the one kept from before (spikes.py): after a loss spike, or
    where the last checkpoint holds weights an update diverged into."""
    manager, spikes = run.manager, run.spikes
    step = manager.latest_step()
    if spikes.spiking:
        return spikes.advice()
    if step is not None and step != spikes.healthy:
        diverged = (f"the last checkpoint written before them, step {step}, holds weights that "
                    f"gave no normal step (an update diverged into them)")
        if spikes.healthy is None:
            return (f"{diverged}, and no checkpoint of this run is known to give a normal loss: "
                    f"start again with a lower optimizer.learning_rate, or check the data")
        return f"{diverged}; {spikes.advice()}"
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
