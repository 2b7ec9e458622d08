import functools

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

from megatrain_jax.loss import IGNORE_ID, chunked_cross_entropy

D = 16


def _inputs(seed, lead, v, layout, dtype=jnp.float32, ignore_frac=0.25):
    # numpy, not jax.random: eager jax ops each cost a compile, which dominates these small tests.
    rng = np.random.default_rng(seed)
    y = rng.standard_normal((*lead, D), np.float32)
    w = rng.standard_normal((D, v) if layout == "dv" else (v, D), np.float32) * (3 / np.sqrt(D))
    t = rng.integers(0, v, lead).astype(np.int32)
    t[rng.random(lead) < ignore_frac] = IGNORE_ID
    return jnp.asarray(y, dtype), jnp.asarray(w, dtype), jnp.asarray(t)


def _dense(y, w, t, layout="dv", softcap=0.0):
    spec = "...d,dv->...v" if layout == "dv" else "...d,vd->...v"
    logits = jnp.einsum(spec, y, w, preferred_element_type=jnp.float32)
    if softcap:  # differentiated by autodiff here, by the custom backward there
        logits = softcap * jnp.tanh(logits / softcap)
    valid = t != IGNORE_ID
    per_tok = optax.softmax_cross_entropy_with_integer_labels(logits, jnp.where(valid, t, 0))
    return jnp.where(valid, per_tok, 0.0).sum(), valid.sum().astype(jnp.float32)


def _mean_and_grads(fn, y, w, t):
    """((loss_sum / count, (loss_sum, count)), (d/dy, d/dw)), traced (call it under jit)."""

    def mean(y, w):
        s, c = fn(y, w, t)
        return s / c, (s, c)

    return jax.value_and_grad(mean, argnums=(0, 1), has_aux=True)(y, w)


@functools.partial(jax.jit, static_argnums=3)
def _both(y, w, t, fn_args):
    """The chunked loss (with the static kwargs in fn_args) and the dense reference, one compile."""
    kwargs = dict(fn_args)
    chunked = _mean_and_grads(lambda y, w, t: chunked_cross_entropy(y, w, t, **kwargs), y, w, t)
    y32, w32 = y.astype(jnp.float32), w.astype(jnp.float32)
    dense = _mean_and_grads(lambda y, w, t: _dense(y, w, t, kwargs["layout"],
                                                   kwargs.get("softcap", 0.0)), y32, w32, t)
    return chunked, dense


def _assert_close(a, b, rtol):
    a, b = np.asarray(a, np.float64), np.asarray(b, np.float64)
    scale = max(np.abs(b).max(), 1e-30)
    np.testing.assert_allclose(a, b, rtol=rtol, atol=rtol * scale)


# V = 100 is not a multiple of any vocab_chunk below; N = 3 * 7 = 21 pads up to a multiple of chunk
# (or fits in one, chunk 64).
# softcap 2: Gemma's final-logit soft-capping, on logits of standard deviation ~3.
@pytest.mark.parametrize(
    "layout,chunk,vocab_chunk,softcap",
    [("dv", 8, 0, 0.0), ("vd", 64, 0, 0.0), ("dv", 5, 32, 0.0), ("vd", 8, 7, 0.0), ("vd", 5, 32, 2.0)]
)
def test_matches_optax(layout, chunk, vocab_chunk, softcap):
    y, w, t = _inputs(0, (3, 7), 100, layout)
    kwargs = (("layout", layout), ("chunk", chunk), ("vocab_chunk", vocab_chunk),
              ("softcap", softcap))
    ((m, (s, c)), (dy, dw)), ((m_ref, (s_ref, c_ref)), (dy_ref, dw_ref)) = _both(y, w, t, kwargs)

    assert s.dtype == c.dtype == jnp.float32 and s.shape == c.shape == ()
    assert float(c) == float(c_ref) and 0 < float(c) < 21
    for x, ref in ((s, s_ref), (m, m_ref), (dy, dy_ref), (dw, dw_ref)):
        _assert_close(x, ref, 1e-6)
    # Ignored tokens get exactly zero gradient.
    assert np.all(np.asarray(dy)[np.asarray(t) == IGNORE_ID] == 0)


def test_all_ignored():
    y, w, _ = _inputs(1, (2, 5), 100, "dv")
    t = jnp.full((2, 5), IGNORE_ID, jnp.int32)
    fn = lambda y, w: chunked_cross_entropy(y, w, t, chunk=4, vocab_chunk=32)
    (s, c), (dy, dw) = jax.jit(jax.value_and_grad(fn, argnums=(0, 1), has_aux=True))(y, w)
    assert float(s) == 0.0 and float(c) == 0.0
    assert np.all(np.asarray(dy) == 0) and np.all(np.asarray(dw) == 0)


def test_out_of_range_targets_stay_finite():
    y, w, t = _inputs(2, (9,), 100, "dv")
    t = jnp.asarray(np.concatenate([[100, 10_000, -5], np.asarray(t)[3:]]), jnp.int32)
    fn = lambda y, w: chunked_cross_entropy(y, w, t, chunk=4, vocab_chunk=32)[0]
    s, (dy, dw) = jax.jit(jax.value_and_grad(fn, argnums=(0, 1)))(y, w)
    assert np.isfinite(float(s)) and np.all(np.isfinite(dy)) and np.all(np.isfinite(dw))


def test_bf16():
    layout = "vd"
    y, w, t = _inputs(3, (2, 9), 100, layout, dtype=jnp.bfloat16)
    kwargs = (("layout", layout), ("chunk", 8), ("vocab_chunk", 32))
    ((m, _), (dy, dw)), ((m_ref, _), (dy_ref, dw_ref)) = _both(y, w, t, kwargs)
    assert dy.dtype == dw.dtype == jnp.bfloat16
    np.testing.assert_allclose(float(m), float(m_ref), rtol=1e-4)
    for g, ref in ((dy, dy_ref), (dw, dw_ref)):
        _assert_close(g.astype(jnp.float32), ref, 2e-2)


def _temp_bytes(fn, *shapes):
    args = [jax.ShapeDtypeStruct(s, d) for s, d in shapes]
    compiled = jax.jit(jax.value_and_grad(fn, argnums=(0, 1))).lower(*args).compile()
    analysis = compiled.memory_analysis()
    if analysis is None:
        pytest.skip("memory_analysis() is not available on this backend")
    return analysis.temp_size_in_bytes


def _shapes(n, v, d=64):
    return ((n, d), jnp.float32), ((d, v), jnp.float32), ((n,), jnp.int32)


def test_memory_is_chunked():
    # Tokens: chunk fixed at 256, V = 4096 whole; temporaries must not scale like N x V.
    tok = lambda y, w, t: chunked_cross_entropy(y, w, t, chunk=256)[0]
    small, big = _temp_bytes(tok, *_shapes(2048, 4096)), _temp_bytes(tok, *_shapes(8192, 4096))
    assert big <= 4.5 * small, (small, big)
    logits_bytes = 8192 * 4096 * 4
    dense = _temp_bytes(lambda y, w, t: _dense(y, w, t)[0], *_shapes(8192, 4096))
    assert dense >= logits_bytes and big < logits_bytes / 8, (big, dense)

    # Vocabulary: vocab_chunk fixed at 1024; apart from weight-gradient-sized fp32 buffers the
    # temporaries must not grow with V.
    voc = lambda y, w, t: chunked_cross_entropy(y, w, t, chunk=256, vocab_chunk=1024)[0]
    non_weight = {v: max(_temp_bytes(voc, *_shapes(1024, v)) - 2 * 64 * v * 4, 0) for v in (8192, 32768)}
    assert non_weight[32768] <= 1.5 * non_weight[8192] + 64 * 1024, non_weight
    assert non_weight[32768] < 1024 * 32768 * 4 / 8, non_weight


def test_jit_traced_weight_and_checkpoint():
    y, w, t = _inputs(4, (2, 6), 50, "vd")
    traces = []

    def loss(y, w, t):
        traces.append(1)
        s, c = chunked_cross_entropy(y, w, t, layout="vd", chunk=5, vocab_chunk=16)
        return s / c

    jitted = jax.jit(loss)
    a, b = jitted(y, w, t), jitted(y, w * 2, t)
    assert len(traces) == 1 and float(a) != float(b)

    grads = jax.jit(lambda y, w, t: (jax.grad(jax.checkpoint(loss), argnums=(0, 1))(y, w, t),
                                     jax.grad(loss, argnums=(0, 1))(y, w, t)))
    for x, ref in zip(*grads(y, w, t)):
        _assert_close(x, ref, 1e-6)
