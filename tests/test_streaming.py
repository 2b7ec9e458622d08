"""What the engine keeps on the compute device, and what a failed or non-finite step leaves."""

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from flax import nnx
from toy_model import Embed

from megatrain_jax import StreamedEngine
from megatrain_jax.engine import fused_adamw, stream
from megatrain_jax.model import ModelConfig, make_block, make_stages

CFG = ModelConfig(vocab_size=64, hidden_size=32, intermediate_size=48, num_layers=8, num_heads=4,
                  num_kv_heads=2)


def engine_for(cfg, *, compute_dtype=jnp.float32, optimizer=None, **kwargs):
    first, last = make_stages(cfg, seed=0)
    return StreamedEngine(first=first, last=last, make_block=lambda i: make_block(cfg, 0, i),
                          num_layers=cfg.num_layers, optimizer=optimizer or optax.adamw(1e-2),
                          max_grad_norm=1.0, compute_dtype=compute_dtype,
                          compute_device=jax.devices("cpu")[0], host_device=jax.devices("cpu")[1],
                          **kwargs)


def batch(cfg, num_micro=2, seq=16, seed=0):
    toks = np.random.default_rng(seed).integers(0, cfg.vocab_size, (num_micro, 2, seq + 1), np.int32)
    return toks[..., :-1], toks[..., 1:]


def on_compute(a, kind="device"):
    return a.sharding.device_set == {jax.devices("cpu")[0]} and a.sharding.memory_kind == kind


# the project's AdamW: the direct update, with which a layer travels as one array (a jitted
# update takes leaves: packing.why_per_leaf)
DIRECT = lambda: fused_adamw.adamw(1e-2)


def count_resident_weights(engine, monkeypatch=None):
    """Runs a step and returns the most layer weight sets ever alive on the compute device at once.

    Every bf16 copy of a layer's weights fetched to the device (one flat array: engine/packing.py)
    is held here, so an array the engine merely stopped referencing still counts: only an
    explicit delete (after the device is done with it) makes it not alive."""
    assert engine.host.packing(1).flat
    shape = (engine.host.packing(1).size,)
    seen, peak = {}, [0]

    def check(phase, layer=None):
        for a in jax.live_arrays():
            if a.shape == shape and a.dtype == jnp.bfloat16 and on_compute(a):
                seen[id(a)] = a
        peak[0] = max(peak[0], sum(not a.is_deleted() for a in seen.values()))

    engine.on_phase = check
    out = engine.train_step(*batch(CFG))
    float(out["loss"])
    return peak[0]


@pytest.mark.parametrize("prefetch", [0, 2])
def test_at_most_prefetch_plus_one_layers_resident(prefetch):
    engine = engine_for(CFG, compute_dtype=jnp.bfloat16, prefetch=prefetch, optimizer=DIRECT())
    assert count_resident_weights(engine) == prefetch + 1
    engine.close()


def test_resident_count_sees_layers_left_to_python(monkeypatch):
    """Guards the test above: without explicit deletes, the count reaches the model's depth."""
    monkeypatch.setattr(stream, "delete", lambda tree, counters=None: None)
    engine = engine_for(CFG, compute_dtype=jnp.bfloat16, prefetch=1, optimizer=DIRECT())
    assert count_resident_weights(engine) >= CFG.num_layers
    engine.close()


def activation_bytes_at_backward_start(num_layers, offload):
    cfg = ModelConfig(**{**CFG.__dict__, "num_layers": num_layers})
    engine = engine_for(cfg, offload_activations=offload)
    found = {}
    # arrays alive before the step (other tests' fixtures in the same process) are not this step's;
    # held, so that no id of theirs can be reused by an array the step makes
    alive_before = jax.live_arrays()
    before = {id(a) for a in alive_before}

    def check(phase, layer=None):
        if phase == "loss":  # the forward is done; the backward starts next
            jax.block_until_ready(jax.live_arrays())
            shape = (2, 2, 16, cfg.hidden_size)  # (micro-batch, batch, seq, hidden): saved inputs
            for kind in ("device", "pinned_host"):
                found[kind] = sum(a.nbytes for a in jax.live_arrays()
                                  if on_compute(a, kind) and a.shape == shape
                                  and id(a) not in before)

    engine.on_phase = check
    float(engine.train_step(*batch(cfg))["loss"])
    engine.close()
    del alive_before
    return found


def test_offloaded_activations_do_not_grow_with_depth():
    two, eight = (activation_bytes_at_backward_start(n, offload=True) for n in (2, 8))
    assert eight["device"] == two["device"]
    assert eight["pinned_host"] == 4 * two["pinned_host"] > 0
    # ...whereas kept on the device they grow with the number of layers
    kept_two, kept_eight = (activation_bytes_at_backward_start(n, offload=False) for n in (2, 8))
    one = 2 * 16 * CFG.hidden_size * 4  # one micro-batch's (B, T, D) in fp32; 2 micro-batches
    assert (kept_two["device"], kept_eight["device"]) == ((2 + 1) * 2 * one, (8 + 1) * 2 * one)
    assert kept_eight["pinned_host"] == 0


def test_offload_changes_nothing_in_the_results():
    engines = [engine_for(CFG, offload_activations=o) for o in (False, True)]
    for seed in range(2):
        losses = [float(e.train_step(*batch(CFG, seed=seed))["loss"]) for e in engines]
        assert losses[0] == losses[1]
    a, b = (jax.tree.map(np.asarray, e.params()) for e in engines)
    jax.tree.map(np.testing.assert_array_equal, a, b)


def snapshot(engine):
    return jax.tree.map(np.array, engine.state())


class Boom(Exception):
    pass


def test_a_step_that_fails_midway_leaves_the_state_as_it_was():
    engine, fresh = engine_for(CFG), engine_for(CFG)
    engine.train_step(*batch(CFG, seed=0))
    fresh.train_step(*batch(CFG, seed=0))
    before = snapshot(engine)

    def fail(phase, layer=None):
        if phase == "backward" and layer == 3:
            raise Boom()

    engine.on_phase = fail
    with pytest.raises(Boom):
        engine.train_step(*batch(CFG, seed=1))
    jax.tree.map(np.testing.assert_array_equal, snapshot(engine), before)
    engine.on_phase = None  # the engine goes on as if the failed step never happened
    a = engine.train_step(*batch(CFG, seed=1))
    b = fresh.train_step(*batch(CFG, seed=1))
    assert float(a["loss"]) == float(b["loss"])
    jax.tree.map(np.testing.assert_array_equal, snapshot(engine), snapshot(fresh))


class PoisonHead(nnx.Module):
    """Mean cross-entropy, NaN for a batch whose first target is negative."""

    def __init__(self, dim, vocab, rngs):
        self.w = nnx.Param(jax.random.normal(rngs.params(), (dim, vocab)) * 0.1)

    def __call__(self, x, targets):
        loss = optax.softmax_cross_entropy_with_integer_labels(x @ self.w[...], jnp.abs(targets))
        return loss.mean() * jnp.where(targets[0, 0] < 0, jnp.nan, 1.0)


@pytest.mark.parametrize("max_grad_norm", [None, 1.0])
def test_a_non_finite_step_changes_nothing(max_grad_norm):
    d, v = 16, 11
    engine = StreamedEngine(first=Embed(v, d, nnx.Rngs(0)), last=PoisonHead(d, v, nnx.Rngs(1)),
                            make_block=lambda i: nnx.Linear(d, d, rngs=nnx.Rngs(2 + i)),
                            num_layers=3, optimizer=optax.adam(1e-2), max_grad_norm=max_grad_norm,
                            compute_dtype=jnp.float32, compute_device=jax.devices("cpu")[0],
                            host_device=jax.devices("cpu")[1])
    toks = np.random.default_rng(0).integers(0, v, (1, 2, 9), np.int32)
    good = toks[..., :-1], toks[..., 1:]
    engine.train_step(*good)
    before = snapshot(engine)
    bad_targets = good[1].copy()
    bad_targets[0, 0, 0] = -1
    out = engine.train_step(good[0], bad_targets)
    assert not np.isfinite(float(out["grad_norm"]))
    jax.tree.map(np.testing.assert_array_equal, snapshot(engine), before)  # optax state too
    assert engine.nonfinite_units() == ["stages", 0, 1, 2]
    out = engine.train_step(*good)  # and the next good step trains as usual
    assert np.isfinite(float(out["grad_norm"])) and engine.nonfinite_units() == []
    assert not np.array_equal(snapshot(engine)["layers"][0]["params"]["kernel"],
                              before["layers"][0]["params"]["kernel"])


def test_params_are_views_valid_until_the_next_step():
    engine = engine_for(ModelConfig(**{**CFG.__dict__, "num_layers": 2}))
    view = engine.params()
    kept = jax.tree.map(np.array, view)
    engine.train_step(*batch(CFG))
    engine.wait()
    with pytest.raises(RuntimeError, match="deleted"):
        np.asarray(view["layers"][0]["wq"])  # updated in place: the old view is gone
    assert not np.array_equal(kept["layers"][0]["wq"], np.asarray(engine.params()["layers"][0]["wq"]))
