"""Checkpoints: bit-exact resume (stop, SIGTERM, SIGKILL between saves), torn async saves never used,
restore into host memory, clear errors for another model or a damaged checkpoint, library API."""

import asyncio
import json
import os
import shutil
import signal
import subprocess
import sys
import time

import jax
import jax.numpy as jnp
import numpy as np
import optax
import orbax.checkpoint as ocp
import pytest
from flax import nnx
from toy_model import Embed, Head

from megatrain_jax import StreamedEngine, checkpoint
from megatrain_jax.cli import run_cli
from megatrain_jax.config import load_config
from megatrain_jax.recipes import build_engine
from megatrain_jax.train import train

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
STEPS = 6
FAST = ["model.num_layers=2", "data.seq_len=32", "data.batch_size=2", "train.compute_dtype=float32",
        f"train.steps={STEPS}", "train.log_every=1", "checkpoint.every=2", "checkpoint.keep=10"]


def make_cfg(run_dir, *extra):
    return load_config(os.path.join(ROOT, "configs/tiny.yaml"), [*FAST, f"run_dir={run_dir}", *extra])


def losses(run_dir, key="loss"):
    records = [json.loads(line) for line in open(os.path.join(run_dir, "metrics.jsonl"))]
    return [(r["step"], r[key]) for r in records]


def saved_state(run_dir, step=None):
    """The state saved as checkpoint `step` (default: the latest), as numpy arrays."""
    manager = checkpoint.make_manager(os.path.join(run_dir, "checkpoints"))
    step = checkpoint.resolve_step(manager, step)
    state = manager.restore(step, args=ocp.args.Composite(state=ocp.args.StandardRestore()))["state"]
    manager.close()
    return jax.tree.map(np.asarray, state)


def assert_states_equal(a, b):
    leaves_a, leaves_b = jax.tree.leaves(a), jax.tree.leaves(b)
    assert jax.tree.structure(a) == jax.tree.structure(b) and len(leaves_a) > 10
    for x, y in zip(leaves_a, leaves_b):
        assert x.dtype == y.dtype and np.array_equal(x, y)


@pytest.fixture(scope="module")
def reference(tmp_path_factory):
    """STEPS uninterrupted steps, an asynchronous checkpoint every 2."""
    run_dir = str(tmp_path_factory.mktemp("reference"))
    train(make_cfg(run_dir), log=lambda *_: None)
    return {"run_dir": run_dir, "losses": losses(run_dir), "final": saved_state(run_dir),
            "smoothed": losses(run_dir, "loss_smooth")}


@pytest.mark.parametrize("sig", [signal.SIGTERM])
def test_signal_mid_run_then_resume_is_bit_exact(tmp_path, reference, sig):
    run_dir = str(tmp_path / "run")

    def log(line):  # the signal arrives while step 3 is being logged, as from another process
        if line.startswith("step     3 |"):
            os.kill(os.getpid(), sig)

    previous = signal.getsignal(sig)
    history = train(make_cfg(run_dir), log=log)
    assert [r["step"] for r in history] == [1, 2, 3]  # stopped after the step it was in
    assert signal.getsignal(sig) is previous  # the handler was put back
    assert checkpoint.make_manager(os.path.join(run_dir, "checkpoints")).all_steps() == [2, 3]

    lines = []
    history = train(make_cfg(run_dir), log=lines.append)
    assert "resumed from checkpoint step 3" in "\n".join(lines)
    assert [r["step"] for r in history] == [4, 5, 6]
    assert losses(run_dir) == reference["losses"]  # every step once, identical floats
    assert losses(run_dir, "loss_smooth") == reference["smoothed"]  # it went on where it stopped
    assert_states_equal(saved_state(run_dir), reference["final"])

    lines = []  # train.steps is the total: a finished run re-run does nothing
    assert train(make_cfg(run_dir), log=lines.append) == []
    assert "nothing to do" in lines[-1] and losses(run_dir) == reference["losses"]


# Runs scripts/train.py with one Orbax or data function replaced, to stop the process at a known
# point (it writes `marker` there and blocks) so the test can SIGKILL it there, not by timing.
RUNNER = r"""
import asyncio, os, runpy, sys, time
mode, marker, arg, *argv = sys.argv[1:]
def reached():
    open(marker, "w").close()
    time.sleep(3600)
if mode == "block_commit":  # the checkpoint of step `arg` is written but never committed
    from orbax.checkpoint._src.path import atomicity
    finalize = atomicity.AtomicRenameTemporaryPath.finalize
    async def blocked(self, *a, **k):
        if self._final_path.name == arg:
            await asyncio.to_thread(reached)
        return await finalize(self, *a, **k)
    atomicity.AtomicRenameTemporaryPath.finalize = blocked
elif mode == "block_batch":  # "N:S": stops before step N takes its batch, once step S is saved
    from megatrain_jax import data
    next_batch, calls = data.PackedDataset.next_batch, []
    step, saved = arg.split(":")
    run_dir = [a for a in argv if a.startswith("run_dir=")][0][len("run_dir="):]
    def blocked(self):
        calls.append(1)
        if len(calls) == int(step):
            while not os.path.isdir(os.path.join(run_dir, "checkpoints", saved)):
                time.sleep(0.01)
            reached()
        return next_batch(self)
    data.PackedDataset.next_batch = blocked
sys.argv = ["train.py", *argv]
runpy.run_path(os.path.join(os.getcwd(), "scripts", "train.py"), run_name="__main__")
"""


def kill_at(tmp_path, mode, arg, run_dir, *extra, timeout=120):
    marker = tmp_path / "marker"
    proc = subprocess.Popen([sys.executable, "-c", RUNNER, mode, str(marker), str(arg),
                             "--config", "configs/tiny.yaml", *FAST, f"run_dir={run_dir}", *extra],
                            cwd=ROOT, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)
    deadline = time.time() + timeout
    while not marker.exists():
        assert proc.poll() is None, proc.stderr.read()
        assert time.time() < deadline
        time.sleep(0.05)
    proc.kill()  # SIGKILL
    assert proc.wait() == -signal.SIGKILL


def test_sigkill_with_the_disk_tier_resumes_bit_exact(tmp_path, reference):
    """The disk tier's files are scratch: after a SIGKILL mid-run (files half-updated) the run
    resumes from its last checkpoint, rewrites them, and ends as the uninterrupted RAM-tier run."""
    run_dir, tier = tmp_path / "run", ["offload.tier=disk", f"offload.path={tmp_path / 'tier'}"]
    kill_at(tmp_path, "block_batch", "6:4", run_dir, *tier, timeout=300)
    # step 5 ran (its updates in the tier's files), unread: a step is read once the next is
    # dispatched, and step 6 was taking its batch
    assert [s for s, _ in losses(run_dir)] == [1, 2, 3, 4]
    lines = []
    train(make_cfg(run_dir, *tier), log=lines.append)
    text = "\n".join(lines)
    assert "resumed from checkpoint step 4" in text and "(this run's files, rewritten)" in text
    assert losses(run_dir) == reference["losses"]
    assert_states_equal(saved_state(run_dir), reference["final"])


def moment_dtypes(state) -> set:
    """The dtypes of the optimizer state's floating leaves (Adam's moments)."""
    return {x.dtype for x in jax.tree.leaves([u["opt_state"] for u in [state["stages"],
                                                                        *state["layers"]]])
            if np.issubdtype(x.dtype, np.floating) or x.dtype == jnp.bfloat16}


def test_bf16_moments_resume_bit_exact_and_change_dtype_only_where_allowed(tmp_path, capsys):
    """optimizer.state_dtype=bfloat16: the moments are saved in bf16, the dtype in the saved
    config. Killed between saves (the train command, SIGKILL, after step 5 with checkpoints 2 and
    4; step 5 not yet read), the run resumes from the last save, step 5 run again, to the
    uninterrupted run's losses and state, bit for bit (each rounding's random bits are a function of the step, the
    leaf and the element). Going on with fp32 moments is refused by name unless
    checkpoint.allow_changes names the key; allowed, the moments are read and cast to fp32.
    (The RAM tier's SIGKILL between saves: this test; the disk tier's, with fp32 moments: the one
    above.)"""
    bf16 = "optimizer.state_dtype=bfloat16"
    reference_dir = tmp_path / "reference"
    train(make_cfg(reference_dir, bf16), log=lambda *_: None)
    final = saved_state(reference_dir)
    assert moment_dtypes(final) == {np.dtype(jnp.bfloat16)}
    manager = checkpoint.make_manager(os.path.join(reference_dir, "checkpoints"))
    assert checkpoint.read_meta(manager, STEPS)[0]["config"]["optimizer"]["state_dtype"] == \
        "bfloat16"
    manager.close()

    run_dir = tmp_path / "run"
    kill_at(tmp_path, "block_batch", "6:4", run_dir, bf16, timeout=300)
    assert [s for s, _ in losses(run_dir)] == [1, 2, 3, 4]  # (step 5: dispatched, not read)
    lines = []
    train(make_cfg(run_dir, bf16), log=lines.append)
    assert "resumed from checkpoint step 4" in "\n".join(lines)
    assert losses(run_dir) == losses(reference_dir)
    assert_states_equal(saved_state(run_dir), final)

    rc = run_cli(lambda: train(make_cfg(run_dir, "train.steps=8",
                                        "checkpoint.allow_changes=[train.steps]")))
    err = capsys.readouterr().err.strip().splitlines()
    assert rc == 2 and len(err) == 1
    assert "config.optimizer.state_dtype is 'bfloat16' in the checkpoint, 'float32' now" in err[0]
    assert "checkpoint.allow_changes=[optimizer.state_dtype]" in err[0]
    history = train(make_cfg(run_dir, "train.steps=8",
                             "checkpoint.allow_changes=[train.steps,optimizer.state_dtype]"),
                    log=lambda *_: None)
    assert [r["step"] for r in history] == [7, 8] and all(np.isfinite(r["loss"]) for r in history)
    assert moment_dtypes(saved_state(run_dir)) == {np.dtype(np.float32)}


def test_sigkill_during_async_save_never_uses_the_torn_checkpoint(tmp_path, reference):
    run_dir = tmp_path / "run"
    kill_at(tmp_path, "block_commit", 4, run_dir)  # step 4's files written, not committed
    ckpt_dir = run_dir / "checkpoints"
    torn = [p for p in os.listdir(ckpt_dir) if p.startswith("4") and p != "4"]
    assert torn and not (ckpt_dir / "4").exists()  # the save really was cut in the middle
    lines = []
    train(make_cfg(run_dir), log=lines.append)
    assert "resumed from checkpoint step 2" in "\n".join(lines)
    assert losses(run_dir) == reference["losses"]
    assert_states_equal(saved_state(run_dir), reference["final"])
    assert_states_equal(saved_state(run_dir, 4), saved_state(reference["run_dir"], 4))


def _delay_writes(monkeypatch, seconds):
    """Holds back every array write of a save, so training runs while the save is in flight."""
    from orbax.checkpoint._src.serialization import serialization
    write = serialization.async_serialize_from_host

    async def delayed(*args, **kwargs):
        await asyncio.sleep(seconds)
        return await write(*args, **kwargs)
    monkeypatch.setattr(serialization, "async_serialize_from_host", delayed)


def test_async_save_is_the_state_of_its_step_while_training_goes_on(tmp_path, monkeypatch):
    # The host update donates (reuses in place) the params and optax state buffers: a save that
    # wrote the live buffers after the next steps' updates would hold a torn, later state.
    cfg = make_cfg(tmp_path / "run")
    engine = build_engine(cfg)
    batch = np.random.default_rng(0).integers(0, 257, size=(1, 2, 33))
    step = lambda: engine.train_step(batch[..., :-1], batch[..., 1:])["loss"].block_until_ready()
    step()
    snapshot = jax.tree.map(np.array, engine.state())  # copies
    _delay_writes(monkeypatch, 2.0)
    manager = checkpoint.make_manager(tmp_path / "ckpt", async_save=True)
    checkpoint.save(manager, 1, engine)
    for _ in range(3):
        step()
    engine.wait()
    assert manager.is_saving_in_progress()  # the updates above ran before anything was written
    live = jax.tree.map(np.asarray, engine.state())
    assert not np.array_equal(jax.tree.leaves(live)[-1], jax.tree.leaves(snapshot)[-1])
    manager.wait_until_finished()
    monkeypatch.undo()
    fresh = build_engine(cfg)
    checkpoint.restore(manager, fresh, 1)
    assert_states_equal(jax.tree.map(np.asarray, fresh.state()), snapshot)
    engine.close(), fresh.close(), manager.close()


def _files(directory):
    return {os.path.join(d, f): os.stat(os.path.join(d, f)).st_mtime_ns
            for d, _, fs in os.walk(directory) for f in fs}


@pytest.fixture
def finished_run(tmp_path, reference):
    run_dir = tmp_path / "run"
    shutil.copytree(reference["run_dir"], run_dir)
    return run_dir


@pytest.mark.parametrize("override,message", [
    ("model.intermediate_size=256", "config.model.intermediate_size is 384 in the checkpoint, 256 now"),
    ("model.num_layers=3", "config.model.num_layers is 2 in the checkpoint, 3 now"),
])
def test_other_model_is_one_line_exit_2_nothing_overwritten(finished_run, capsys, override, message):
    before = _files(finished_run)
    rc = run_cli(lambda: train(make_cfg(finished_run, override, "train.steps=8")))
    err = capsys.readouterr().err.strip().splitlines()
    assert rc == 2 and len(err) == 1
    assert err[0].startswith("error: checkpoint step 6 in ") and message in err[0]
    assert _files(finished_run) == before


def test_shape_mismatch_names_the_first_parameter_and_both_shapes(finished_run):
    # No config to compare (a library user): the saved shapes are checked against the engine's.
    engine = build_engine(make_cfg(finished_run, "model.intermediate_size=256"))
    manager = checkpoint.make_manager(finished_run / "checkpoints")
    before = jax.tree.map(np.array, engine.state())
    with pytest.raises(checkpoint.CheckpointError) as e:
        checkpoint.restore(manager, engine)
    assert "layers/0/params/w_down has shape (384, 128) float32 in the checkpoint, " \
           "shape (256, 128) float32 in the model" in str(e.value)
    assert_states_equal(jax.tree.map(np.asarray, engine.state()), before)  # nothing loaded


def test_corrupted_latest_checkpoint_names_step_and_moving_it_out_recovers(finished_run, capsys,
                                                                           reference):
    for d, _, fs in os.walk(finished_run / "checkpoints" / "6" / "state"):
        for f in fs:  # truncated files, as a full disk or a dying node leaves them
            with open(os.path.join(d, f), "r+b") as fh:
                fh.truncate(os.path.getsize(os.path.join(d, f)) // 3)
    before = _files(finished_run)
    rc = run_cli(lambda: train(make_cfg(finished_run)))
    err = capsys.readouterr().err.strip().splitlines()
    assert rc == 2 and len(err) == 1
    assert "checkpoint step 6 in " in err[0] and "is unreadable" in err[0]
    assert "move it out of" in err[0] and "resume from step 4" in err[0]
    assert "bound method" not in err[0]  # the storage error itself, not tensorstore's spec dump

    # Resuming from step 4 while step 6 is there would keep the damaged 6 and drop the retrained
    # one (a checkpoint is never overwritten): refused up front, nothing written.
    rc = run_cli(lambda: train(make_cfg(finished_run, "checkpoint.resume_step=4")))
    err = capsys.readouterr().err.strip().splitlines()
    assert rc == 2 and len(err) == 1 and "newer checkpoints (steps 6)" in err[0]
    assert _files(finished_run) == before

    shutil.move(finished_run / "checkpoints" / "6", finished_run / "damaged-6")
    lines = []
    train(make_cfg(finished_run), log=lines.append)
    assert "resumed from checkpoint step 4" in "\n".join(lines)
    assert losses(finished_run) == reference["losses"]
    assert_states_equal(saved_state(finished_run), reference["final"])  # the retrained step 6


# ----------------------------------------------------------------------------- library API
D, V = 16, 40


class MLPBlock(nnx.Module):
    def __init__(self, rngs):
        self.w1 = nnx.Param(jax.random.normal(rngs.params(), (D, 2 * D)) * 0.1)
        self.w2 = nnx.Param(jax.random.normal(rngs.params(), (2 * D, D)) * 0.1)

    def __call__(self, x):
        return x + jax.nn.gelu(x @ self.w1[...]) @ self.w2[...]


def custom_engine(seed):
    compute, host = jax.devices()[:2]  # conftest: CPU devices; the first plays the accelerator
    return StreamedEngine(first=Embed(V, D, nnx.Rngs(seed), scale=0.1),
                          last=Head(D, V, nnx.Rngs(seed + 1)),
                          make_block=lambda i: MLPBlock(nnx.Rngs(seed + 10 + i)), num_layers=3,
                          optimizer=optax.adam(1e-2), max_grad_norm=1.0, compute_dtype=jnp.float32,
                          compute_device=compute, host_device=host)


@pytest.mark.parametrize("part", ["params", "opt_state"])
def test_save_refuses_a_state_that_is_not_finite(tmp_path, part):
    # The last guard: whatever let a NaN into the state, no checkpoint is written from it, so
    # `keep` never rotates a healthy checkpoint out for a poisoned one.
    engine = custom_engine(0)
    manager = checkpoint.make_manager(tmp_path / "ckpt", keep=1, async_save=False)
    checkpoint.save(manager, 1, engine)
    layer = jax.tree.map(np.array, engine.state()["layers"][2])
    leaf = [x for x in jax.tree.leaves(layer[part]) if x.ndim][0]
    leaf.flat[3] = np.nan
    engine.load_unit(2, layer)
    with pytest.raises(checkpoint.SaveError, match=f"refusing to save checkpoint step 2: "
                                                   f"layers/2/{part} is not finite"):
        checkpoint.save(manager, 2, engine)
    assert manager.all_steps() == [1]
    state = jax.tree.map(np.asarray, engine.state())
    assert checkpoint.first_non_finite(state) == f"layers/2/{part}"
    engine.close(), manager.close()


def test_library_save_restore_round_trips_a_custom_block_into_host_memory(tmp_path, monkeypatch):
    tokens = np.random.default_rng(0).integers(0, V, size=(2, 4, 9))
    step = lambda e: float(e.train_step(tokens[..., :-1], tokens[..., 1:])["loss"])
    engine = custom_engine(0)
    for _ in range(2):
        step(engine)
    manager = checkpoint.make_manager(tmp_path / "ckpt", keep=2)
    checkpoint.save(manager, 2, engine, {"note": "mine"})
    manager.close()
    expected = jax.tree.map(np.array, engine.state())

    restored = custom_engine(7)  # other initial weights
    loaded = []
    load_unit = restored.load_unit
    monkeypatch.setattr(restored, "load_unit", lambda w, s: (loaded.append(s), load_unit(w, s)))
    manager = checkpoint.make_manager(tmp_path / "ckpt")
    meta = checkpoint.restore(manager, restored)
    assert meta == {"note": "mine", "step": 2}
    host = restored.host_device
    assert len(loaded) == 1 + 3  # unit by unit: the stages, then each layer
    for x in jax.tree.leaves(loaded):  # what Orbax read: already in host memory
        assert x.devices() == {host}
        assert x.sharding.memory_kind == host.default_memory().kind
    assert_states_equal(jax.tree.map(np.asarray, restored.state()), expected)
    assert step(restored) == step(engine)  # and it trains on identically
    engine.close(), restored.close(), manager.close()
