"""The streamed engine against a plain, un-offloaded reference (whole-model value_and_grad + optax)."""

import contextlib

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from flax import nnx

from megatrain_jax.data import document_context

from megatrain_jax.engine import StreamedEngine
from megatrain_jax.loss import IGNORE_ID
from megatrain_jax.model import Execution, ModelConfig, make_block, make_stages
from megatrain_jax.recipes import build_optimizer
from megatrain_jax.config import OptimizerConfig

CFG = ModelConfig(vocab_size=61, hidden_size=64, intermediate_size=96, num_layers=4, num_heads=4,
                  num_kv_heads=2)
STEPS = 6
OPT = OptimizerConfig(learning_rate=1e-2, warmup_steps=2, weight_decay=0.1)


def batches(num_micro, batch, seq=16, seed=0):
    rng = np.random.default_rng(seed)
    toks = rng.integers(0, CFG.vocab_size, size=(STEPS, num_micro, batch, seq + 1), dtype=np.int32)
    return [(t[..., :-1], t[..., 1:]) for t in toks]


def make_engine(cfg, devices, max_grad_norm, prefetch=1, execution=Execution(), **kwargs):
    first, last = make_stages(cfg, seed=0, execution=execution)
    compute, host = devices
    return StreamedEngine(first=first, last=last,
                          make_block=lambda i: make_block(cfg, 0, i, execution=execution),
                          num_layers=cfg.num_layers, optimizer=build_optimizer(OPT, STEPS),
                          max_grad_norm=max_grad_norm, compute_dtype=jnp.float32, prefetch=prefetch,
                          compute_device=compute, host_device=host, **kwargs)


def reference_run(cfg, data, max_grad_norm, contexts=None):
    """The same model and optimizer, fp32, whole model on one device, one batch per step, with
    dense attention (xla) and the full logits: `optax.softmax_cross_entropy_with_integer_labels`
    averaged over the counted (not ignored) tokens."""
    first, last = make_stages(cfg, seed=0)
    stages_def, stages = nnx.split((first, last))
    blocks = [nnx.split(make_block(cfg, 0, i)) for i in range(cfg.num_layers)]
    block_def = blocks[0][0]
    params = {"stages": nnx.to_pure_dict(stages),
              "layers": [nnx.to_pure_dict(b[1]) for b in blocks]}

    def loss_fn(params, inputs, targets, context):
        first, last = nnx.merge(stages_def, params["stages"])
        x = first(inputs)
        for p in params["layers"]:
            x = nnx.merge(block_def, p)(x, context)
        counted = targets != IGNORE_ID
        losses = optax.softmax_cross_entropy_with_integer_labels(
            last.logits(x), jnp.where(counted, targets, 0))
        return jnp.sum(jnp.where(counted, losses, 0.0)) / jnp.sum(counted)

    tx = build_optimizer(OPT, STEPS)
    if max_grad_norm is not None:
        tx = optax.chain(optax.clip_by_global_norm(max_grad_norm), tx)
    opt_state = tx.init(params)

    @jax.jit
    def step(params, opt_state, inputs, targets, context):
        loss, grads = jax.value_and_grad(loss_fn)(params, inputs, targets, context)
        updates, opt_state = tx.update(grads, opt_state, params)
        return optax.apply_updates(params, updates), opt_state, loss

    flat = lambda x: x.reshape(-1, x.shape[-1])  # all micro-batches of a step form one batch
    losses = []
    for n, (inputs, targets) in enumerate(data):
        context = None if contexts is None else jax.tree.map(flat, contexts[n])
        params, opt_state, loss = step(params, opt_state, flat(inputs), flat(targets), context)
        losses.append(float(loss))
    return losses, params


def assert_trees_close(a, b, rtol, skip=()):
    """Every tensor within `rtol` relative error in L2 norm. (Element-wise is too strict for Adam:
    an element whose gradient is ~0 moves by noise-sign * lr, so rounding-level differences in the
    gradient show up as lr-sized differences in a handful of elements.)"""
    for (path, x), y in zip(jax.tree_util.tree_leaves_with_path(a), jax.tree.leaves(b), strict=True):
        name = jax.tree_util.keystr(path)
        if any(s in name for s in skip):
            continue
        x, y = np.asarray(x, np.float64), np.asarray(y, np.float64)
        assert x.shape == y.shape, name
        err = np.linalg.norm(x - y) / max(np.linalg.norm(y), 1e-30)
        assert err <= rtol, f"{name}: relative error {err:.2e} > {rtol:.0e}"


DEVICE_SETUPS = {"two_devices": lambda: tuple(jax.devices("cpu")[:2]),
                 "one_device": lambda: (jax.devices("cpu")[0],) * 2}


@pytest.mark.parametrize("devices,num_micro,max_grad_norm",
                         [("two_devices", 1, None), ("one_device", 2, None), ("two_devices", 2, 0.5)],
                         ids=["plain", "micro2_one_device", "micro2_clip"])
def test_streamed_matches_reference(devices, num_micro, max_grad_norm):
    data = batches(num_micro, batch=4 // num_micro)
    ref_losses, ref_params = reference_run(CFG, data, max_grad_norm)
    engine = make_engine(CFG, DEVICE_SETUPS[devices](), max_grad_norm)
    losses, norms = [], []
    for inputs, targets in data:
        out = engine.train_step(inputs, targets)
        losses.append(float(out["loss"]))
        norms.append(float(out["grad_norm"]))
    np.testing.assert_allclose(losses, ref_losses, rtol=1e-5)
    assert_trees_close(engine.params(), ref_params, rtol=1e-5)
    if max_grad_norm is not None:  # clipping must have been active for this test to mean much
        assert max(norms) > max_grad_norm
    engine.close()


def test_params_live_on_host_device():
    compute, host = jax.devices("cpu")[:2]
    engine = make_engine(CFG, (compute, host), None)
    for leaf in jax.tree.leaves(engine.state()):  # fresh (optax init included) ...
        assert leaf.devices() == {host} and leaf.committed
    inputs, targets = batches(1, 2)[0]
    engine.train_step(inputs, targets)
    for leaf in jax.tree.leaves(engine.state()):  # ... and after a step
        assert leaf.devices() == {host} and leaf.committed
    engine.close()


# A key bias shifts every score of a query by the same amount, which softmax ignores: its true
# gradient is zero and Adam's normalisation blows rounding noise up to a full step, so it is the one
# parameter that cannot match to 1e-5 (in any two implementations).
VARIANTS = {"qkv_bias": (dict(qkv_bias=True, num_kv_heads=2), ("k_bias",)),
            "tied_embeddings": (dict(tie_embeddings=True, num_kv_heads=4), ())}


@pytest.mark.parametrize("variant", VARIANTS)
def test_model_variants_match_reference(variant):
    options, skip = VARIANTS[variant]
    cfg = ModelConfig(vocab_size=61, hidden_size=32, intermediate_size=48, num_layers=2,
                      num_heads=4, **options)
    data = batches(1, 2)
    ref_losses, ref_params = reference_run(cfg, data, 1.0)
    engine = make_engine(cfg, tuple(jax.devices("cpu")[:2]), 1.0)
    losses = [float(engine.train_step(i, t)["loss"]) for i, t in data]
    np.testing.assert_allclose(losses, ref_losses, rtol=1e-5)
    assert_trees_close(engine.params(), ref_params, rtol=1e-5, skip=skip)
    engine.close()


def test_prefetch_depth_does_not_change_results():
    data = batches(1, 2)[:2]
    engines = [make_engine(CFG, tuple(jax.devices("cpu")[:2]), 1.0, prefetch=p) for p in (1, 0, 3)]
    for inputs, targets in data:
        losses = [float(e.train_step(inputs, targets)["loss"]) for e in engines]
        assert losses[1:] == losses[:1] * 2
    for other in engines[1:]:
        assert_trees_close(engines[0].params(), other.params(), rtol=0)


def test_bf16_compute_trains_close_to_fp32():
    """bf16 streaming is not exact, but must track the fp32 run (catches a dtype mix-up)."""
    data = batches(1, 4)
    ref_losses, _ = reference_run(CFG, data, 1.0)
    first, last = make_stages(CFG, seed=0)
    engine = StreamedEngine(first=first, last=last, make_block=lambda i: make_block(CFG, 0, i),
                            num_layers=CFG.num_layers, optimizer=build_optimizer(OPT, STEPS),
                            max_grad_norm=1.0, compute_dtype=jnp.bfloat16,
                            compute_device=jax.devices("cpu")[0], host_device=jax.devices("cpu")[1])
    losses = [float(engine.train_step(i, t)["loss"]) for i, t in data]
    np.testing.assert_allclose(losses, ref_losses, rtol=2e-2)
    for leaf in jax.tree.leaves(engine.params()):
        assert leaf.dtype == jnp.float32  # master weights stay fp32
    engine.close()


@contextlib.contextmanager
def count_compiles():
    """Collects one entry per XLA compilation inside the block."""
    compiles = []

    def on_event(event, duration, **kwargs):
        if event == "/jax/core/compile/backend_compile_duration":
            compiles.append(event)

    jax.monitoring.register_event_duration_secs_listener(on_event)
    try:
        yield compiles
    finally:
        jax.monitoring.unregister_event_duration_listener(on_event)


def test_compiles_nothing_after_first_step():
    engine = make_engine(CFG, tuple(jax.devices("cpu")[:2]), 1.0)
    data = batches(2, 2)
    engine.train_step(*data[0])
    engine.wait()
    with count_compiles() as compiles:
        for inputs, targets in data[1:4]:
            float(engine.train_step(inputs, targets)["loss"])
        engine.wait()
    assert compiles == []
    engine.close()


def test_compile_counter_sees_a_first_step():
    """Guards the test above: the counter must see the first step's compiles."""
    cfg = ModelConfig(vocab_size=37, hidden_size=48, intermediate_size=40, num_layers=2,
                      num_heads=2, num_kv_heads=1)
    with count_compiles() as compiles:
        engine = make_engine(cfg, tuple(jax.devices("cpu")[:2]), 1.0)
        toks = np.random.default_rng(0).integers(0, 37, size=(1, 2, 9), dtype=np.int32)
        engine.train_step(toks[..., :-1], toks[..., 1:])
        engine.close()
    assert len(compiles) >= 5


def packed_batches(cfg, num_micro, batch, seq, eos, seed=0):
    """Token windows of several documents each (eos-separated), some targets ignored."""
    rng = np.random.default_rng(seed)
    toks = rng.integers(0, cfg.vocab_size - 1, size=(STEPS, num_micro, batch, seq + 1), dtype=np.int32)
    toks[rng.random(toks.shape) < 0.15] = eos
    data, contexts = [], []
    for t in toks:
        targets = t[..., 1:].copy()
        targets[rng.random(targets.shape) < 0.2] = IGNORE_ID
        data.append((t[..., :-1], targets))
        contexts.append(document_context(t[..., :-1], eos))
    return data, contexts


# Every long-context option against the plain reference (dense attention, full logits, no tiles):
# offloaded activations, document masks, a window shorter than the sequence, blockwise attention
# over a ragged last block, tiled MLP, chunked loss over tokens and vocabulary, ignored targets.
LONG_CONTEXT = {
    "offload_documents_window": (
        dict(sliding_window=7), Execution(attention="blockwise", attention_block=8, tile_size=12,
                                          loss_chunk=20, loss_vocab_chunk=16), True, True),
    "tied_vocab_chunks": (
        dict(tie_embeddings=True, num_kv_heads=4), Execution(attention="blockwise", attention_block=16,
                                                             loss_chunk=24, loss_vocab_chunk=25),
        False, False),
}


@pytest.mark.parametrize("name", LONG_CONTEXT)
def test_long_context_options_match_reference(name):
    options, execution, offload, documents = LONG_CONTEXT[name]
    cfg = ModelConfig(**{**dict(vocab_size=61, hidden_size=32, intermediate_size=48, num_layers=3,
                             num_heads=4, num_kv_heads=2), **options})
    data, contexts = packed_batches(cfg, num_micro=2, batch=2, seq=30, eos=cfg.vocab_size - 1)
    data, contexts = data[:3], (contexts[:3] if documents else None)
    ref_losses, ref_params = reference_run(cfg, data, 1.0, contexts)
    engine = make_engine(cfg, tuple(jax.devices("cpu")[:2]), 1.0, execution=execution,
                         offload_activations=offload)
    losses = [float(engine.train_step(i, t, None if contexts is None else contexts[n])["loss"])
              for n, (i, t) in enumerate(data)]
    np.testing.assert_allclose(losses, ref_losses, rtol=1e-5)
    assert_trees_close(engine.params(), ref_params, rtol=1e-5)
    engine.close()
