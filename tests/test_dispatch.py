"""The dispatching thread's work in a step (stream.Counters): what the engine counts at its own
call sites is what a profiler trace sees it launch, and it waits only where the schedule says (a
layer's retire), counted by kind. CPU device 1 stands for the accelerator, device 0 for the
host (copies made inside the calls)."""

import collections
import concurrent.futures
import dataclasses
import glob
import threading

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

from megatrain_jax import StreamedEngine
from megatrain_jax.engine import schedule
from megatrain_jax.model import ModelConfig, make_block, make_stages

CPU = jax.devices("cpu")
CFG = ModelConfig(vocab_size=53, hidden_size=32, intermediate_size=48, num_layers=4, num_heads=4,
                  num_kv_heads=2)
M = 4
TOKENS = np.random.default_rng(5).integers(0, CFG.vocab_size, (3, M, 2, 17), np.int32)


def engine_for(**kwargs):
    first, last = make_stages(CFG, seed=0)
    return StreamedEngine(first=first, last=last, make_block=lambda i: make_block(CFG, 0, i),
                          num_layers=CFG.num_layers, optimizer=optax.adamw(1e-3),
                          max_grad_norm=1.0, compute_dtype=jnp.bfloat16, compute_device=CPU[1],
                          host_device=CPU[0], copies="jit", **kwargs)


def warm(engine):
    """Two steps (the first compiles), their updates done."""
    for t in TOKENS[:2]:
        float(engine.train_step(t[..., :-1], t[..., 1:])["loss"])
    engine.wait()


def step(engine):
    t = TOKENS[2]
    return engine.train_step(t[..., :-1], t[..., 1:])


def launches(trace_dir, annotation: str) -> int:
    """Executables launched from the thread that ran `annotation`, inside it (the trace's
    line of that thread)."""
    data = jax.profiler.ProfileData.from_file(
        glob.glob(f"{trace_dir}/**/*.xplane.pb", recursive=True)[0])
    counts = []
    for plane in data.planes:
        for line in plane.lines:
            events = list(line.events)
            spans = [(e.start_ns, e.end_ns) for e in events if e.name == annotation]
            if spans:
                (start, end), = spans
                counts.append(sum(1 for e in events if start <= e.start_ns <= end and
                                  e.name.startswith("CommonPjRtLoadedExecutable::ExecuteHelper")))
    (count,) = counts
    return count


@pytest.mark.parametrize("host_lookup", [False, True], ids=["device path", "host lookup"])
def test_the_counted_calls_are_the_launches_a_profiler_trace_sees(host_lookup, tmp_path):
    """One call per layer and pass and a few for the stages: the device path's embedding, head,
    embedding backward and stages' gradient; the host lookup's embedding (on the host device),
    head, last unit's gradient and the layers' total sum of squares."""
    engine = engine_for(host_lookup=host_lookup)
    warm(engine)
    before = dataclasses.replace(engine.counters)
    options = jax.profiler.ProfileOptions()
    options.python_tracer_level = 0
    with jax.profiler.trace(str(tmp_path), profiler_options=options):
        with jax.profiler.TraceAnnotation("the step"):
            result = step(engine)
        after = dataclasses.replace(engine.counters)
        float(result["loss"])
        engine.wait()
    engine.close()
    calls = after.calls - before.calls
    assert calls == launches(tmp_path, "the step") == 2 * CFG.num_layers + 4
    assert after.arg_leaves > before.arg_leaves and after.deleted > before.deleted


class Syncs:
    """Every way the dispatching (main) thread may wait, counted as it waits: jax's
    block_until_ready, a numpy view of a jax array, a future not yet done (a host update)."""

    def __init__(self, monkeypatch):
        self.seen = collections.Counter()
        main = lambda: threading.current_thread() is threading.main_thread()
        wait, asarray, result = jax.block_until_ready, np.asarray, concurrent.futures.Future.result

        def counted_wait(tree):
            self.seen["block_until_ready"] += main()
            return wait(tree)

        def counted_asarray(x, *args, **kwargs):
            self.seen["np.asarray"] += main() and isinstance(x, jax.Array)
            return asarray(x, *args, **kwargs)

        def counted_result(future, *args, **kwargs):
            self.seen["future"] += main() and not future.done()
            return result(future, *args, **kwargs)

        monkeypatch.setattr(jax, "block_until_ready", counted_wait)
        monkeypatch.setattr(np, "asarray", counted_asarray)
        monkeypatch.setattr(concurrent.futures.Future, "result", counted_result)


@pytest.mark.parametrize("host_lookup", [False, True], ids=["device path", "host lookup"])
def test_a_step_waits_only_at_its_retires_and_counts_each_wait(host_lookup, monkeypatch):
    """Its updates done before it, a step's dispatching thread waits at each layer's retire but
    each pass's last (schedule.layer_ops), and with the host lookup at most once more at its end,
    for the first stage's backward on the host thread (where that is not done yet): no other
    wait, and the engine counts each by kind."""
    engine = engine_for(host_lookup=host_lookup)
    warm(engine)
    before = dict(engine.counters.syncs)
    retires = sum(op == schedule.RETIRE for op, _ in schedule.layer_ops(
        CFG.num_layers, engine.prefetch, schedule.JIT))
    with monkeypatch.context() as patched:
        syncs = Syncs(patched)
        result = step(engine)
    seen = {k: v for k, v in syncs.seen.items() if v}
    counted = {k: v - before.get(k, 0) for k, v in engine.counters.syncs.items()
               if v > before.get(k, 0)}
    first_stage = seen.get("future", 0)
    assert first_stage <= host_lookup
    assert seen == {"block_until_ready": 2 * retires, **({"future": 1} if first_stage else {})}
    assert counted == {schedule.RETIRE_WAIT: 2 * retires,
                       **({schedule.FIRST_STAGE_WAIT: 1} if first_stage else {})}
    assert sum(counted.values()) <= 2 * CFG.num_layers + 4
    float(result["loss"])
    engine.close()


class Read(float):
    """A step's output scalar that notes when the loop reads it (float())."""

    def __new__(cls, value, note):
        obj = super().__new__(cls, float(value))
        obj.note = note
        return obj

    def __float__(self):
        self.note()
        return super().__float__()


def test_the_training_loop_reads_a_step_once_the_next_is_dispatched(tmp_path, monkeypatch):
    """Past the steps the advice times (and but where the weights are read or the run may end:
    here the last step, with its checkpoint), step n's loss and gradient norm are read after step
    n + 1 is dispatched, so the device is never left idle for that read; the records are those of
    the run that reads each at once."""
    from megatrain_jax.after_step import ADVICE_AFTER
    from megatrain_jax.config import load_config
    from megatrain_jax.train import train
    steps = ADVICE_AFTER + 4
    cfg = lambda run_dir: load_config("configs/tiny.yaml", [
        "model.num_layers=2", "data.seq_len=32", "data.batch_size=2", f"train.steps={steps}",
        "checkpoint.every=0", f"run_dir={run_dir}"])
    reference = train(cfg(tmp_path / "reference"), log=lambda *_: None)

    events, train_step = [], StreamedEngine.train_step

    def noted(engine, *args, **kwargs):
        out = train_step(engine, *args, **kwargs)
        step = sum(e[0] == "dispatch" for e in events) + 1
        events.append(("dispatch", step))
        note = lambda: events.append(("read", step))
        return {**out, "loss": Read(out["loss"], note), "grad_norm": Read(out["grad_norm"], note)}
    monkeypatch.setattr(StreamedEngine, "train_step", noted)
    history = train(cfg(tmp_path / "run"), log=lambda *_: None)
    at = {e: k for k, e in reversed(list(enumerate(events)))}  # each event's first place
    for step in range(1, steps + 1):
        late = ADVICE_AFTER < step < steps
        assert (at[("read", step)] > at[("dispatch", step + 1)]) if late else (
            at[("read", step)] < at.get(("dispatch", step + 1), len(events))), step
    keep = ("step", "loss", "grad_norm", "lr")
    assert [{k: r[k] for k in keep} for r in history] == [{k: r[k] for k in keep}
                                                         for r in reference]
