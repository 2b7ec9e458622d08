"""Faults during a run, through train() and the real command line: non-finite steps, a config the
plan refuses, device out of memory at the first step."""

import json
import os
import re
import shutil
import subprocess
import sys

import jax
import pytest

from megatrain_jax import StreamedEngine, checkpoint
from megatrain_jax.config import ConfigError, load_config
from megatrain_jax.errors import TrainingError
from megatrain_jax.recipes import build_engine
from megatrain_jax.train import train

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
TINY = os.path.join(ROOT, "configs", "tiny.yaml")
FAST = ["model.num_layers=2", "data.seq_len=32", "data.batch_size=2", "checkpoint.keep=10"]


def run_train(*overrides):
    return subprocess.run([sys.executable, os.path.join(ROOT, "scripts", "train.py"), "--config",
                           TINY, *FAST, *overrides], capture_output=True, text=True, cwd=ROOT,
                          timeout=300)


def test_diverging_run_skips_non_finite_steps_then_stops_exit_1(tmp_path):
    run_dir = tmp_path / "run"
    result = run_train(f"run_dir={run_dir}", "optimizer.learning_rate=1e30", "optimizer.warmup_steps=0",
                       "train.steps=30", "checkpoint.every=1", "train.max_bad_steps=2")
    assert result.returncode == 1, result.stderr
    errors = result.stderr.strip().splitlines()
    assert len(errors) == 1 and errors[0].startswith("error: stopped at step "), result.stderr
    assert "train.max_bad_steps=2" in errors[0] and "Traceback" not in result.stderr
    records = [json.loads(line) for line in open(run_dir / "metrics.jsonl")]
    assert [r.get("skipped", False) for r in records[-2:]] == [True, True]
    assert "skipped, weights and optimizer state unchanged" in result.stdout
    # No checkpoint holds a non-finite number (the engine kept the last finite state).
    cfg = load_config(str(run_dir / "config.yaml"))
    engine = build_engine(cfg)
    manager = checkpoint.make_manager(str(run_dir / "checkpoints"))
    assert manager.all_steps()
    for step in manager.all_steps():
        checkpoint.restore(manager, engine, step)
        assert checkpoint.first_non_finite(engine.state()) is None, step
    manager.close()
    engine.close()


def test_a_config_that_cannot_fit_is_refused_before_anything_is_written(tmp_path):
    run_dir = tmp_path / "run"
    result = run_train(f"run_dir={run_dir}", "model.hidden_size=16384", "model.intermediate_size=65536",
                       "model.num_heads=128", "model.num_kv_heads=8", "model.num_layers=400")
    assert result.returncode == 2, result.stderr
    errors = result.stderr.strip().splitlines()
    assert len(errors) == 1 and "does not fit" in errors[0], result.stderr
    assert not run_dir.exists()


def test_out_of_memory_at_the_first_step_is_one_line_and_leaves_no_trace(tmp_path, monkeypatch):
    def oom(self, *args, **kwargs):
        raise jax.errors.JaxRuntimeError(
            "RESOURCE_EXHAUSTED: Out of memory while trying to allocate 34364211200 bytes.")

    monkeypatch.setattr(StreamedEngine, "train_step", oom)
    run_dir = tmp_path / "run"
    cfg = load_config(TINY, [*FAST, f"run_dir={run_dir}", "train.steps=2"])
    with pytest.raises(ConfigError) as e:
        train(cfg, log=lambda *a: None)
    line = str(e.value)
    assert "\n" not in line and "out of memory at step 1" in line and "34364211200" in line
    assert "train.offload_activations" in line and "the plan predicted a device peak" in line
    assert not run_dir.exists()


def strict_records(path) -> list[dict]:
    """metrics.jsonl's records, refusing NaN and Infinity (not JSON)."""
    def refuse(constant):
        raise ValueError(f"{path}: {constant} is not JSON")
    return [json.loads(line, parse_constant=refuse) for line in open(path)]


@pytest.fixture(scope="module")
def healthy_run(tmp_path_factory):
    """A run of 3 healthy steps saved every step, for the tests below to resume (a copy each)."""
    run_dir = tmp_path_factory.mktemp("healthy") / "run"
    train(load_config(TINY, [*FAST, f"run_dir={run_dir}", "checkpoint.every=1", "train.steps=3"]),
          log=lambda *a: None)
    return run_dir


def test_skipped_steps_write_no_checkpoint_and_keep_rotates_none_of_the_healthy_out(tmp_path,
                                                                                   healthy_run):
    """3 healthy steps saved every step, then a diverging resume with keep=3: the steps it skips
    write nothing, so the kept checkpoints are the last 3 steps that trained; the stop line names
    the last one whose weights trained normally (the one before the update at 1e30) and how to
    go back to it."""
    run_dir = tmp_path / "run"
    shutil.copytree(healthy_run, run_dir)
    cfg = lambda *o: load_config(TINY, [*FAST, f"run_dir={run_dir}", "checkpoint.every=1", *o])
    manager = checkpoint.make_manager(str(run_dir / "checkpoints"))
    assert manager.all_steps() == [1, 2, 3]
    with pytest.raises(TrainingError) as e:
        train(cfg("train.steps=12", "optimizer.learning_rate=1.0e30", "checkpoint.keep=3",
                  "checkpoint.allow_changes=[train.steps,optimizer]"), log=lambda *a: None)
    records = strict_records(run_dir / "metrics.jsonl")
    skipped = [r["step"] for r in records if r.get("skipped")]
    trained = [r["step"] for r in records if not r.get("skipped")]
    assert len(skipped) == 3 and skipped == list(range(skipped[0], skipped[0] + 3))
    manager.reload()
    assert manager.all_steps() == trained[-3:]  # none of the skipped, the last 3 that trained
    line = str(e.value)
    assert "\n" not in line and f"stopped at step {skipped[-1]}" in line
    # the last that trained took the update at 1e30: its weights gave no normal step
    assert (f"the last checkpoint written before them, step {trained[-1]}, holds weights that "
            f"gave no normal step" in line)
    assert f"checkpoint step {trained[-2]}, the last whose weights gave a normal loss" in line
    assert "checkpoint.allow_changes=[optimizer]" in line
    # A skipped step's grad norm is null, and the rate it logs is the one the optimizer would use:
    # the schedule's at the updates made so far (skipped steps make none), not at the step.
    assert all(r["grad_norm"] is None for r in records if r.get("skipped"))
    assert len({r["lr"] for r in records if r.get("skipped")}) == 1
    assert records[skipped[0] - 1]["lr"] > records[skipped[0] - 2]["lr"]  # the warmup rises
    manager.close()


def test_a_resume_diverging_through_finite_steps_keeps_the_last_healthy_checkpoint(tmp_path,
                                                                                  healthy_run):
    """A resume at optimizer.learning_rate=1, saving every step with checkpoint.keep=3: its
    losses stay finite but climb far above their median. The last checkpoint whose weights gave
    a normal loss survives the rotation, and the line at the spike and the run's last line name
    it and how to go back to it; the other checkpoints rotate as keep says."""
    run_dir = tmp_path / "run"
    shutil.copytree(healthy_run, run_dir)
    lines = []
    overrides = [*FAST, f"run_dir={run_dir}", "checkpoint.every=1", "checkpoint.keep=3",
                 "train.steps=12", "optimizer.learning_rate=1",
                 "checkpoint.allow_changes=[train.steps,optimizer]"]
    try:
        train(load_config(TINY, overrides), log=lines.append)
        last = lines[-1]
    except TrainingError as e:  # it may end in non-finite steps: the stop line names it too
        last = str(e)
    records = strict_records(run_dir / "metrics.jsonl")
    spike = [x for x in lines if " normal losses (" in x]
    assert len(spike) == 1, "\n".join(lines)  # once, at the first spike
    first = int(spike[0].split("|")[0].split()[1])
    kept = int(re.search(r"checkpoint step (\d+), the last whose weights gave a normal loss",
                         spike[0]).group(1))
    # its weights gave the loss of step kept + 1, a normal one; the next step's was the spike
    assert kept + 2 == first and records[first - 1]["loss"] > 3 * records[kept]["loss"]
    # judged against every loss before it, those of the run it resumed too (its checkpoint's)
    assert f"the median of the last {first - 1} normal losses" in spike[0]
    assert records[kept]["loss"] < records[0]["loss"] * 1.1
    advice = (f"checkpoint step {kept}, the last whose weights gave a normal loss, is kept out of "
              f"checkpoint.keep's rotation; to go back to it, move the checkpoints after step "
              f"{kept} out of {run_dir / 'checkpoints'}")
    assert advice in spike[0] and advice in last
    manager = checkpoint.make_manager(str(run_dir / "checkpoints"))
    saved = [r["step"] for r in records if not r.get("skipped")]
    assert manager.all_steps() == sorted({kept, *saved[-3:]})
    manager.close()


def test_an_engine_after_close_says_it_is_closed(tmp_path):
    """After close() a step raised "cannot schedule new futures after shutdown" and state()
    still returned a dict (of a disk tier: files already gone). Every call that steps or reads
    or loads state says the engine is closed; a second close() is harmless."""
    engine = build_engine(load_config(TINY, [*FAST, f"run_dir={tmp_path}/run"]))
    inputs = jax.numpy.zeros((1, 2, 32), jax.numpy.int32)
    float(engine.train_step(inputs, inputs)["loss"])
    state = jax.tree.map(lambda x: x.copy(), engine.state())
    engine.close()
    engine.close()
    closed = re.escape("the engine is closed (close() was called): it cannot step nor give or "
                       "take state; build a new engine")
    for call in (lambda: engine.train_step(inputs, inputs), lambda: engine.evaluate(inputs, inputs),
                 engine.state, engine.params, engine.wait, lambda: engine.load_state(state),
                 lambda: engine.load_unit(0, state["layers"][0])):
        with pytest.raises(RuntimeError, match=f"^{closed}$"):
            call()


def test_a_divergence_names_the_last_checkpoint_whose_weights_trained_normally(tmp_path):
    """bf16 moments at lr 1e30 (warming up from 0): step 2 updates into weights whose loss is
    ln(257), as normal as any, but whose gradient is not finite; checkpoint 2 holds them. The
    stop named checkpoint 2 to resume from: now checkpoint 1, the last whose weights gave a
    normal step, kept out of the rotation, with checkpoint 2 named as diverged."""
    run_dir = tmp_path / "run"
    with pytest.raises(TrainingError) as e:
        train(load_config(TINY, [*FAST, f"run_dir={run_dir}", "optimizer.state_dtype=bfloat16",
                                 "optimizer.learning_rate=1e30", "train.steps=8",
                                 "checkpoint.every=1", "checkpoint.keep=1",
                                 "train.max_bad_steps=2"]), log=lambda *a: None)
    records = strict_records(run_dir / "metrics.jsonl")
    assert [r.get("skipped", False) for r in records] == [False, False, True, True]
    assert records[2]["loss"] < records[0]["loss"] * 1.1  # a loss that looks normal
    assert str(e.value) == (
        f"stopped at step 4: 2 consecutive steps with a non-finite gradient "
        f"(train.max_bad_steps=2, last in stages, 0, 1); no update and no checkpoint was made "
        f"from them; the last checkpoint written before them, step 2, holds weights that gave no "
        f"normal step (an update diverged into them); checkpoint step 1, the last whose weights "
        f"gave a normal loss, is kept out of checkpoint.keep's rotation; to go back to it, move "
        f"the checkpoints after step 1 out of {run_dir / 'checkpoints'} and run again with a "
        f"lower optimizer.learning_rate and checkpoint.allow_changes=[optimizer] (or check the "
        f"data)")
    manager = checkpoint.make_manager(str(run_dir / "checkpoints"))
    assert manager.all_steps() == [1, 2]  # keep=1, and the healthy one kept out of rotation
    manager.close()
