"""The host lookup (engine/lookup.py): an untied embedding's rows are gathered on the host and
cross to the device, its table never does; the rows' gradient comes back and the host
scatter-adds it into the table's dense gradient. Training equals the device path bit for bit."""

import dataclasses
import logging

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from test_streaming import batch, engine_for

from megatrain_jax import StreamedEngine
from megatrain_jax.config import OptimizerConfig
from megatrain_jax.model import ModelConfig, make_block, make_stages
from megatrain_jax.recipes import build_optimizer

CFG = ModelConfig(vocab_size=64, hidden_size=32, intermediate_size=48, num_layers=2, num_heads=4,
                  num_kv_heads=2)


def run(engine, steps=3, num_micro=2):
    out = []
    for k in range(steps):
        r = engine.train_step(*batch(CFG, num_micro=num_micro, seed=k))
        out += [float(r["loss"]), float(r["grad_norm"])]
    ev = engine.evaluate(*batch(CFG, num_micro=num_micro, seed=9))
    return out + [float(ev["loss"])], jax.tree.map(np.asarray, engine.state())


@pytest.mark.parametrize("compute_dtype", [jnp.float32, jnp.bfloat16])
def test_host_lookup_trains_exactly_as_the_device_path(compute_dtype):
    """Losses, gradient norms (clipped: max_grad_norm=1), an evaluation and the whole state
    (master weights, Adam moments) after 3 steps of 2 micro-batches, bit for bit."""
    results = {}
    for on in (True, False):
        engine = engine_for(CFG, compute_dtype=compute_dtype, host_lookup=on)
        results[on] = run(engine)
        assert engine.host_lookup == on
        engine.close()
    assert results[True][0] == results[False][0]
    for x, y in zip(jax.tree.leaves(results[True][1]), jax.tree.leaves(results[False][1]),
                    strict=True):
        np.testing.assert_array_equal(x, y)


@pytest.mark.parametrize("grad_dtype", [jnp.float32, jnp.bfloat16])
def test_the_tables_gradient_lives_in_buffers_kept_from_step_to_step(grad_dtype):
    """The host backward's table-sized buffers (the fp32 accumulator, and with bf16 gradients
    unit 0's gradient the pool casts into) are the same from step 2 on: cleared where they lie,
    never made fresh (page faults of a table a step); the run equals the device path bit for
    bit in both gradient dtypes (the pool's cast rounds as XLA's)."""
    from megatrain_jax.engine import fused_adamw
    if fused_adamw.kernel() is None:
        pytest.skip("no C++ compiler")
    results, pointers = {}, []
    for on in (True, False):
        first, last = make_stages(CFG, seed=0)
        cpu = jax.devices("cpu")
        engine = StreamedEngine(  # the fused AdamW (the direct update: no gradient donated)
            first=first, last=last, make_block=lambda i: make_block(CFG, 0, i),
            num_layers=CFG.num_layers, optimizer=build_optimizer(OptimizerConfig(), 10),
            max_grad_norm=1.0, compute_dtype=jnp.bfloat16, compute_device=cpu[0],
            host_device=cpu[1], host_lookup=on, grad_dtype=grad_dtype)
        assert engine.host_update == "direct"
        losses = []
        for k in range(3):
            r = engine.train_step(*batch(CFG, num_micro=2, seed=k))
            losses += [float(r["loss"]), float(r["grad_norm"])]
            engine.wait()
            if on:
                table = engine.first_stage.table
                kept = table._fp32 + (table._out or [])
                pointers.append([x.unsafe_buffer_pointer() for x in kept])
        results[on] = losses, jax.tree.map(np.asarray, engine.state())
        engine.close()
    assert len(pointers[0]) == (1 if grad_dtype == jnp.float32 else 2)
    assert pointers[0] == pointers[1] == pointers[2]
    assert results[True][0] == results[False][0]
    for x, y in zip(jax.tree.leaves(results[True][1]), jax.tree.leaves(results[False][1]),
                    strict=True):
        np.testing.assert_array_equal(x, y)


@pytest.mark.parametrize("grad_dtype", [jnp.float32, jnp.bfloat16])
def test_unit0s_fp32_gradient_is_the_accumulator_itself(grad_dtype):
    """The host backward makes unit 0's gradient from the table's fp32 accumulator as
    stage_units.gradient does; in fp32 it takes the accumulator's buffer (donated: no copy of the
    table's gradient), in bf16 the cast writes a new one and the accumulator is kept."""
    from megatrain_jax.engine import lookup, stage_units
    held = ((0, (3, 4)),)
    acc = [jnp.arange(12, dtype=jnp.float32).reshape(3, 4) - 5.5]
    want = stage_units.gradient(acc, [], (0,), (), held, grad_dtype, None)
    pointer = acc[0].unsafe_buffer_pointer()
    got = lookup.unit0_gradient(acc, (0,), held, grad_dtype)
    assert got[0].dtype == grad_dtype
    np.testing.assert_array_equal(got[0], want[0])
    fp32 = grad_dtype == jnp.float32
    assert acc[0].is_deleted() == fp32
    assert (got[0].unsafe_buffer_pointer() == pointer) == fp32


def test_the_embedding_table_never_crosses():
    """Per step, the bytes into the device drop by the table's twice (the embedding and its
    backward no longer fetch it) less the rows that cross instead, and the bytes out by the
    table's gradient less the rows' gradient."""
    num_micro, rows, seq = 2, 2, 16  # test_streaming.batch's micro-batch: 2 rows of 16
    per_step = {}
    for on in (True, False):
        engine = engine_for(CFG, compute_dtype=jnp.bfloat16, host_lookup=on)
        engine.train_step(*batch(CFG, num_micro=num_micro))
        engine.wait()
        h2d, d2h = engine.counters.bytes_h2d, engine.counters.bytes_d2h
        float(engine.train_step(*batch(CFG, num_micro=num_micro, seed=1))["loss"])
        engine.wait()
        per_step[on] = (engine.counters.bytes_h2d - h2d, engine.counters.bytes_d2h - d2h)
        engine.close()
    table = CFG.vocab_size * CFG.hidden_size
    row_elements = num_micro * rows * seq * CFG.hidden_size
    assert per_step[False][0] - per_step[True][0] == 2 * table * 2 - row_elements * 2  # bf16
    assert per_step[False][1] - per_step[True][1] == table * 4 - row_elements * 2  # fp32 out


def test_tied_embeddings_keep_the_device_path_and_a_warning_says_why(caplog):
    """host_lookup=True that cannot apply: a warning (what the command line shows), not an info
    line."""
    engine = engine_for(dataclasses.replace(CFG, tie_embeddings=True), host_lookup=True)
    with caplog.at_level(logging.INFO, logger="megatrain_jax.engine.streamed"):
        float(engine.train_step(*batch(CFG))["loss"])
    engine.close()
    assert not engine.host_lookup
    warned = [r.getMessage() for r in caplog.records if r.levelno >= logging.WARNING]
    assert len(warned) == 1, caplog.text
    assert warned[0].startswith("host_lookup=True does not apply (host lookup off: the first and "
                                "last stages share a variable")


def test_by_default_only_where_it_moves_fewer_bytes(caplog):
    """host_lookup=None: a step of 2 x 2 x 16 tokens against a 64-row table uses the lookup; a
    step of 8 x 4 x 16 tokens, whose rows outweigh the table twice over, fetches the table."""
    for num_micro, rows, expected in ((2, 2, True), (8, 4, False)):
        engine = engine_for(CFG, compute_dtype=jnp.bfloat16)
        toks = np.random.default_rng(0).integers(0, CFG.vocab_size, (num_micro, rows, 17),
                                                 np.int32)
        with caplog.at_level(logging.INFO, logger="megatrain_jax.engine.streamed"):
            float(engine.train_step(toks[..., :-1], toks[..., 1:])["loss"])
        engine.close()
        assert engine.host_lookup == expected
    assert "host lookup off: its rows and their gradient (65,536 bytes a step) outweigh" in (
        caplog.text)


def test_copies_in_the_calls_keep_the_device_path_by_default(caplog):
    """On the accelerator path (copies made inside the jitted calls) auto keeps the first stage on
    the device even where the host lookup moves fewer bytes (the step above's 2 x 2 x 16 tokens):
    the host backward would end every step with the device idle; the log says so. host_lookup=True
    still takes it, and both train the same bits."""
    toks = np.random.default_rng(0).integers(0, CFG.vocab_size, (2, 2, 17), np.int32)
    out = {}
    for on in (None, True):
        engine = engine_for(CFG, compute_dtype=jnp.bfloat16, host_lookup=on, copies="jit")
        with caplog.at_level(logging.INFO, logger="megatrain_jax.engine.streamed"):
            out[on] = [float(engine.train_step(toks[..., :-1], toks[..., 1:])["loss"])
                       for _ in range(2)]
        engine.close()
        assert engine.host_lookup == bool(on)
    assert out[None] == out[True]
    assert ("host lookup off: copies in the calls: the device path's copies of the first stage "
            "cross beside compute") in caplog.text
