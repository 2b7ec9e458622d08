"""Held-out evaluation: StreamedEngine.evaluate against a plain forward, the data split, and the
training loop's eval (which must not change training by a bit)."""

import json
import math
import os

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from flax import nnx

from megatrain_jax import commands
from megatrain_jax import train as train_lib
from megatrain_jax import data as data_lib
from megatrain_jax.config import Config, load_config, resume_changes, to_dict
from megatrain_jax.recipes import build_engine, load_data
from megatrain_jax.train import train

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
# One tiny model for every test here (the engine tests and the train() runs share compilations):
# 2 layers, M x B x T = 2 x 2 x 32 tokens a step, fp32, dense attention.
FAST = ["model.num_layers=2", "model.hidden_size=32", "model.intermediate_size=48",
        "model.num_heads=2", "model.num_kv_heads=1", "data.seq_len=32", "data.batch_size=2",
        "data.micro_batches=2", "train.steps=4", "train.attention=xla", "checkpoint.async=false"]
M, B, T, VOCAB = 2, 2, 32, 257


def tiny_config(*overrides):
    return load_config(os.path.join(ROOT, "configs", "tiny.yaml"),
                       [*FAST, f"data.path={ROOT}/megatrain_jax/texts/devils_dictionary.txt",
                        *overrides])


def batch(seed):
    toks = np.random.default_rng(seed).integers(0, VOCAB, (M, B, T + 1), dtype=np.int32)
    return toks[..., :-1], toks[..., 1:]


def snapshot(engine):
    return jax.tree.map(np.array, engine.state())


def reference_loss(engine, inputs, targets):
    """The model's modules applied in order with jax, whole, unstreamed, with the full logits
    and optax's cross-entropy, averaged over every token of every micro-batch."""
    params = jax.tree.map(np.array, engine.params())

    @jax.jit
    def loss(params, inputs, targets):
        first, last = nnx.merge(engine.stages_graphdef, params["stages"])
        x = first(inputs)
        for p in params["layers"]:
            x = nnx.merge(engine.block_graphdef, p)(x)
        return jnp.mean(optax.softmax_cross_entropy_with_integer_labels(last.logits(x), targets))

    return float(loss(params, inputs.reshape(-1, T), targets.reshape(-1, T)))


def count_compiles(compiles):
    def on_event(event, duration, **kwargs):
        if event == "/jax/core/compile/backend_compile_duration":
            compiles.append(event)
    return on_event


@pytest.fixture(scope="module")
def engine():
    """An engine that took 3 steps, with an evaluation right after each (while the step's host
    updates are pending): {"engine", "evals"}."""
    # compute on one device, state on another: every fetch is a copy (train() below runs with
    # both on one, where a fetch is the bus copy itself)
    engine = build_engine(tiny_config(), compute_device=jax.devices("cpu")[0],
                          host_device=jax.devices("cpu")[1])
    evals = []
    for n in range(3):
        engine.train_step(*batch(n))
        evals.append(engine.evaluate(*batch(99)))
    yield {"engine": engine, "evals": evals}
    engine.close()


def test_evaluate_matches_a_plain_forward_and_compiles_once(engine):
    engine, evals = engine["engine"], engine["evals"]
    inputs, targets = batch(99)
    out = evals[-1]  # taken while the last step's host updates were pending
    loss = float(out["loss"])
    assert float(out["weight"]) == M * B * T
    assert loss == pytest.approx(float(out["loss_sum"]) / (M * B * T), rel=1e-7)
    assert loss == pytest.approx(reference_loss(engine, inputs, targets), rel=1e-6, abs=1e-6)
    compiles = []
    listener = count_compiles(compiles)
    jax.monitoring.register_event_duration_secs_listener(listener)
    try:
        again = engine.evaluate(inputs, targets)
        float(engine.evaluate(*batch(2))["loss"])
    finally:
        jax.monitoring.unregister_event_duration_listener(listener)
    assert compiles == []  # evaluation after the first compiles nothing
    assert float(again["loss"]) == loss
    assert len({float(o["loss"]) for o in evals}) == 3  # each saw the weights after its step


def test_evaluate_changes_nothing(engine):
    """Bit for bit: evaluate leaves params and optimizer state as they were. (That training with
    evaluations equals training without: test_training_with_eval_equals_training_without.)"""
    engine = engine["engine"]
    before = snapshot(engine)
    float(engine.evaluate(*batch(7))["loss"])
    for x, y in zip(jax.tree.leaves(before), jax.tree.leaves(snapshot(engine)), strict=True):
        np.testing.assert_array_equal(x, y)


# ----------------------------------------------------------------------------- data


def test_eval_fraction_comes_from_the_end_and_is_never_trained_on():
    tokens = np.arange(1000, dtype=np.int32)  # each token is its own offset
    train_tokens, held_out = data_lib.split_tail(tokens, 0.2)
    assert len(held_out) == 200 and held_out[0] == 800 and held_out[-1] == 999
    np.testing.assert_array_equal(np.concatenate([train_tokens, held_out]), tokens)
    ds = data_lib.PackedDataset(train_tokens, seq_len=7, batch_size=3, seed=0, num_micro_batches=2)
    seen = set()
    for _ in range(3 * ds.num_windows // ds.windows_per_batch):  # three epochs
        inputs, targets = ds.next_batch()
        assert targets.max() < 800 and inputs.max() < 800
        seen.update(inputs.ravel().tolist())
    assert max(seen) > 780  # the windows do reach the end of the training part
    batches = data_lib.eval_batches(held_out, seq_len=7, batch_size=3, num_micro_batches=2,
                                    num_batches=4, what="x")
    assert len(batches) == 4
    for n, (inputs, targets) in enumerate(batches):  # consecutive windows, in order
        assert inputs.shape == targets.shape == (2, 3, 7) and inputs.dtype == np.int32
        start = 800 + n * 42
        np.testing.assert_array_equal(inputs.ravel(), np.concatenate(
            [np.arange(start + w * 7, start + w * 7 + 7) for w in range(6)]))
        np.testing.assert_array_equal(targets, inputs + 1)
    again = data_lib.eval_batches(held_out, seq_len=7, batch_size=3, num_micro_batches=2,
                                  num_batches=4, what="x")
    for (x, t), (y, u) in zip(batches, again):  # the same every evaluation
        np.testing.assert_array_equal(x, y)
        np.testing.assert_array_equal(t, u)
    # fewer batches than asked when the held-out part holds fewer; none: one line naming it
    assert len(data_lib.eval_batches(held_out, seq_len=7, batch_size=3, num_micro_batches=2,
                                     num_batches=100, what="x")) == 199 // 42
    with pytest.raises(data_lib.DataError, match="data.eval_fraction=0.01: too small for one eval"):
        data_lib.eval_batches(tokens[990:], seq_len=7, batch_size=3, num_micro_batches=2,
                              num_batches=4, what="data.eval_fraction=0.01")


def test_load_data_splits_the_training_file():
    text = os.path.join(ROOT, "megatrain_jax", "texts", "devils_dictionary.txt")
    base = [f"data.path={text}", "data.seq_len=32", "data.batch_size=2", "data.micro_batches=2"]
    whole, none = load_data(load_config(os.path.join(ROOT, "configs", "tiny.yaml"), base))
    dataset, evals = load_data(load_config(os.path.join(ROOT, "configs", "tiny.yaml"),
                                           base + ["data.eval_fraction=0.25",
                                                   "train.eval_batches=3"]))
    assert none is None
    cut = len(whole.tokens) - int(len(whole.tokens) * 0.25)
    assert len(dataset.tokens) == cut
    np.testing.assert_array_equal(dataset.tokens, whole.tokens[:cut])
    assert len(evals) == 3
    for n, (inputs, targets, context) in enumerate(evals):
        assert inputs.shape == (2, 2, 32) and context is None
        first = cut + n * 4 * 32
        np.testing.assert_array_equal(inputs[0, 0], whole.tokens[first:first + 32])


def test_resume_compares_the_split():
    saved = to_dict(Config())
    del saved["data"]["eval_fraction"], saved["data"]["eval_path"]  # a checkpoint before them
    assert resume_changes(saved, Config()) == []
    cfg = load_config(None, ["data.eval_fraction=0.1"])
    assert resume_changes(saved, cfg) == [("data.eval_fraction", 0.0, 0.1)]
    cfg = load_config(None, ["data.eval_path=held_out.txt"])
    assert resume_changes(saved, cfg) == [("data.eval_path", "", "held_out.txt")]


# ----------------------------------------------------------------------------- the training loop

def run_train(run_dir, monkeypatch, *overrides):
    """(history, metrics records, log lines, the engine's final state) of a train() run."""
    cfg = tiny_config(f"run_dir={run_dir}", *overrides)
    final = []

    def built(*args, **kwargs):  # its state read as train() closes it (a closed engine gives none)
        engine = build_engine(*args, **kwargs)
        close = engine.close
        engine.close = lambda: (final.append(jax.tree.map(np.array, engine.state())), close())
        return engine

    monkeypatch.setattr(train_lib, "build_engine", built)
    lines = []
    history = train(cfg, log=lines.append)
    records = [json.loads(x) for x in (run_dir / "metrics.jsonl").read_text().splitlines()]
    return history, records, lines, final[0]


def test_training_with_eval_equals_training_without(tmp_path, monkeypatch):
    held_out = tmp_path / "held_out.txt"
    held_out.write_text(open(os.path.join(ROOT, "README.md")).read()[:5000])
    plain = run_train(tmp_path / "plain", monkeypatch)
    evaluated = run_train(tmp_path / "eval", monkeypatch, f"data.eval_path={held_out}", "train.eval_every=2",
                          "train.eval_batches=2")
    (_, r0, lines0, state0), (h1, r1, lines1, state1) = plain, evaluated
    assert [r["loss"] for r in r0] == [r["loss"] for r in r1]  # bit for bit
    assert [r["grad_norm"] for r in r0] == [r["grad_norm"] for r in r1]
    for x, y in zip(jax.tree.leaves(state0), jax.tree.leaves(state1), strict=True):
        np.testing.assert_array_equal(x, y)  # final weights and optimizer state
    # the eval run logs and records its evaluations, at step 2 and at the end
    assert not any("eval loss" in line or line.startswith("eval:") for line in lines0)
    assert not any("eval_loss" in r for r in r0)
    assert [r["step"] for r in r1] == [1, 2, 3, 4]
    evals = [r for r in r1 if "eval_loss" in r]
    assert [r["step"] for r in evals] == [2, 4]
    assert sum(line.startswith("eval: 2 batches of 128 tokens from ") for line in lines1) == 1
    assert [r.get("eval_loss") for r in h1] == [r.get("eval_loss") for r in r1]  # returned too
    for r in evals:
        assert 0 < r["eval_loss"] < 10
        assert r["eval_ppl"] == pytest.approx(math.exp(r["eval_loss"]))
        line = f"step {r['step']:5d} | eval loss {r['eval_loss']:.4f} | ppl {r['eval_ppl']:.2f}"
        assert line in lines1
    assert evals[1]["eval_loss"] < evals[0]["eval_loss"]  # it learns, and the eval sees it


@pytest.mark.parametrize("overrides,message", [
    (["data.eval_fraction=0.7"], "data.eval_fraction must be 0 (none) or in (0, 0.5], got 0.7"),
    (["data.eval_fraction=0.1", "data.eval_path=x.txt"],
     "data.eval_path ('x.txt') and data.eval_fraction (0.1) are both set"),
    (["data.eval_path={tmp}/missing.txt"], "data.eval_path: data file not found: {tmp}/missing.txt"),
    (["data.eval_fraction=0.0001"], "data.eval_fraction=0.0001 (38 tokens of"),
    (["train.eval_every=-1"], "train.eval_every must be >= 0"),
    (["train.eval_batches=0"], "train.eval_batches must be >= 1"),
], ids=["fraction", "both", "missing_file", "too_small", "every", "batches"])
def test_bad_eval_input_is_one_line_exit_2(tmp_path, capsys, overrides, message):
    run_dir = tmp_path / "run"
    overrides = [o.format(tmp=tmp_path) for o in overrides]
    code = commands.train(["--config", os.path.join(ROOT, "configs", "tiny.yaml"),
                           f"run_dir={run_dir}", *overrides])
    err = capsys.readouterr().err
    assert code == 2
    lines = err.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("error: ")
    assert message.format(tmp=tmp_path) in lines[0]
    assert not run_dir.exists()  # nothing written
