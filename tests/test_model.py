"""The model's long-context paths: packed documents (segment ids + restarted RoPE positions),
sliding windows, the tiled MLP, blockwise attention inside a block, and the chunked (sum, count)
head. All fp32 on small shapes; each path is checked against the plain one it must equal."""

import dataclasses
import functools

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from flax import nnx

from megatrain_jax.data import document_context
from megatrain_jax.loss import IGNORE_ID
from megatrain_jax.model import Execution, ModelConfig, make_block, make_stages

CFG = ModelConfig(vocab_size=61, hidden_size=32, intermediate_size=48, num_layers=2, num_heads=4,
                  num_kv_heads=2)
EOS = 0


def _normal(seed, *shape):
    return jnp.asarray(np.random.default_rng(seed).standard_normal(shape), jnp.float32)


def _random_params(abstract, seed):
    """The params of `abstract` (from nnx.eval_shape) drawn with numpy: no init to compile.
    Norm scales near 1, matrices N(0, 0.2^2) so that attention is far from uniform."""
    rng = np.random.default_rng(seed)
    draw = lambda s: (1 + 0.1 * rng.standard_normal(s.shape) if len(s.shape) == 1
                      else 0.2 * rng.standard_normal(s.shape))
    return jax.tree.map(lambda s: jnp.asarray(draw(s), jnp.float32), nnx.state(abstract))


def _stack(cfg, execution, num_layers):
    """(params, x, context) -> x through num_layers blocks, and random params for them."""
    abstract = nnx.eval_shape(lambda: make_block(cfg, 0, 0, execution))
    graphdef = nnx.graphdef(abstract)

    def run(params, x, context):
        for p in params:
            x = nnx.merge(graphdef, p)(x, context)
        return x

    return run, [_random_params(abstract, seed) for seed in range(num_layers)]


@functools.partial(jax.jit, static_argnums=0)
def _out_and_grads(run, params, x, context, r):
    """run(params, x, context) and the gradients of sum(out * r) wrt params and x (one compile)."""
    out, vjp = jax.vjp(lambda p, x: run(p, x, context), params, x)
    return out, vjp(r)


def _assert_trees_close(actual, expected, rtol):
    """Every leaf within rtol of the largest entry of its expected value (at least 1)."""
    for a, e in zip(jax.tree.leaves(actual), jax.tree.leaves(expected), strict=True):
        a, e = np.asarray(a), np.asarray(e)
        np.testing.assert_allclose(a, e, rtol=0, atol=rtol * max(np.abs(e).max(), 1.0))


@pytest.mark.parametrize("implementation", ["xla", "blockwise"])
def test_packed_documents_equal_each_document_alone(implementation):
    T, splits = 16, (7, 10)  # row b holds a document of splits[b] tokens (EOS last), then another
    tokens = np.random.default_rng(0).integers(1, CFG.vocab_size, size=(2, T))
    for b, n in enumerate(splits):
        tokens[b, n - 1] = EOS
    context = {k: jnp.asarray(v) for k, v in document_context(tokens, EOS).items()}
    np.testing.assert_array_equal(context["positions"][0], [*range(7), *range(9)])
    x = _normal(1, 2, T, CFG.hidden_size)
    run, params = _stack(CFG, Execution(attention=implementation, attention_block=4), 2)
    run = jax.jit(run)
    packed = run(params, x, context)
    # Each document alone, at the start of a row: what follows it cannot reach it (causal), so
    # every document is zero-padded to T and all four run as one batch without context.
    docs = [(b, lo, hi) for b, n in enumerate(splits) for lo, hi in ((0, n), (n, T))]
    alone = jnp.stack([jnp.pad(x[b, lo:hi], ((0, T - hi + lo), (0, 0))) for b, lo, hi in docs])
    alone = run(params, alone, None)
    for i, (b, lo, hi) in enumerate(docs):
        np.testing.assert_allclose(packed[b, lo:hi], alone[i, :hi - lo], rtol=0, atol=1e-5)


@pytest.mark.parametrize("implementation", ["xla", "blockwise"])
def test_sliding_window_reaches_exactly_window_tokens_back(implementation):
    window, T, p = 4, 12, 3
    cfg = dataclasses.replace(CFG, sliding_window=window)
    run, params = _stack(cfg, Execution(attention=implementation, attention_block=4), 1)
    run = jax.jit(run)
    x = _normal(2, 1, T, cfg.hidden_size)
    out = run(params, x, None)
    perturbed = run(params, x.at[:, p].add(1.0), None)
    # Output t sees input p iff 0 <= t - p < window: t = p + window - 1 does, t = p + window not.
    for t in range(T):
        if p <= t < p + window:
            assert np.abs(perturbed[:, t] - out[:, t]).max() > 1e-3, t
        else:
            np.testing.assert_array_equal(perturbed[:, t], out[:, t], err_msg=f"t={t}")


WINDOWED = dataclasses.replace(CFG, sliding_window=5)  # shorter than T and than the blocks


@pytest.fixture(scope="module")
def windowed_block():
    """A windowed block's params, inputs of T=19 with two documents per row, a cotangent, and the
    plain path's (xla attention, untiled MLP) output and gradients: what the other paths must give."""
    T = 19
    tokens = np.random.default_rng(4).integers(1, CFG.vocab_size, size=(2, T))
    tokens[0, 11], tokens[1, 4] = EOS, EOS
    context = {k: jnp.asarray(v) for k, v in document_context(tokens, EOS).items()}
    x, r = _normal(5, 2, T, CFG.hidden_size), _normal(6, 2, T, CFG.hidden_size)
    run, params = _stack(WINDOWED, Execution(attention="xla"), 1)
    return params, x, context, r, _out_and_grads(run, params, x, context, r)


def test_tiled_mlp_equals_untiled_values_and_gradients(windowed_block):
    params, x, context, r, expected = windowed_block
    tiled, _ = _stack(WINDOWED, Execution(attention="xla", tile_size=4), 1)  # 19 = 4 * 4 + 3
    _assert_trees_close(_out_and_grads(tiled, params, x, context, r), expected, 1e-6)


def test_tiled_mlp_backward_holds_tiles_not_the_sequence():
    """Compiled, not run: a block's backward at T=8192 with MLP tiles of 256 needs less temporary
    memory than one (B, T, F) fp32 array (the untiled backward holds several: ~268 MiB here)."""
    cfg = dataclasses.replace(CFG, intermediate_size=1024)
    execution = Execution(attention="blockwise", attention_block=256, tile_size=256)
    graphdef, params = nnx.split(nnx.eval_shape(lambda: make_block(cfg, 0, 0, execution)))
    x = jax.ShapeDtypeStruct((1, 8192, cfg.hidden_size), jnp.float32)
    grad = jax.grad(lambda p, x: nnx.merge(graphdef, p)(x).sum(), argnums=(0, 1))
    temp = jax.jit(grad).lower(params, x).compile().memory_analysis().temp_size_in_bytes
    assert temp < 8192 * cfg.intermediate_size * 4, temp / 2**20


def test_blockwise_attention_in_a_block_equals_xla(windowed_block):
    params, x, context, r, expected = windowed_block
    blockwise, _ = _stack(WINDOWED, Execution(attention="blockwise", attention_block=8), 1)
    _assert_trees_close(_out_and_grads(blockwise, params, x, context, r), expected, 1e-5)


def test_qk_norm_normalises_each_query_and_key_head():
    """Qwen3's q/k norms: only a qk_norm block has them ((H,) each, counted by num_params), and
    they are applied: the output differs from the same weights without them, depends on their
    scales, and no longer depends on the size of any one query or key head."""
    # H = 16, not hidden / heads; eps ~0, so that rescaling a head is undone exactly (fp32 rounding)
    cfg = dataclasses.replace(CFG, qk_norm=True, head_dim=16, rms_norm_eps=1e-10)
    plain_cfg = dataclasses.replace(cfg, qk_norm=False)
    abstract, plain_abstract = (nnx.eval_shape(lambda c=c: make_block(c, 0, 0))
                                for c in (cfg, plain_cfg))
    params = nnx.to_pure_dict(_random_params(abstract, 0))
    assert params["q_norm"].shape == params["k_norm"].shape == (16,)
    plain_params = nnx.to_pure_dict(nnx.state(plain_abstract))
    assert set(params) - set(plain_params) == {"q_norm", "k_norm"}
    for c, a in ((cfg, abstract), (plain_cfg, plain_abstract)):
        block = sum(x.size for x in jax.tree.leaves(nnx.state(a)))
        stages = sum(x.size for x in jax.tree.leaves(nnx.state(nnx.eval_shape(
            lambda: make_stages(c, 0)))))
        assert c.num_params() == c.num_layers * block + stages
    assert cfg.num_params() - plain_cfg.num_params() == cfg.num_layers * 2 * 16

    def run(a, p, x):
        state = nnx.state(a)
        nnx.replace_by_pure_dict(state, p)
        return nnx.merge(nnx.graphdef(a), state)(x)

    run = jax.jit(run, static_argnums=0)
    x = _normal(7, 2, 9, cfg.hidden_size)
    out = run(abstract, params, x)
    without = {k: v for k, v in params.items() if k not in ("q_norm", "k_norm")}
    assert np.abs(out - run(plain_abstract, without, x)).max() > 1e-2
    for key in ("q_norm", "k_norm"):
        assert np.abs(out - run(abstract, {**params, key: 2 * params[key]}, x)).max() > 1e-2
    # one query head and one key head scaled: rms_norm over H undoes it (not over all heads)
    scaled = {**params, "wq": params["wq"].at[:, 1].multiply(5.0),
              "wk": params["wk"].at[:, 0].multiply(0.2)}
    np.testing.assert_allclose(run(abstract, scaled, x), out, rtol=0, atol=1e-5)
    assert np.abs(out - run(plain_abstract, {k: v for k, v in scaled.items()
                                             if k in without}, x)).max() > 1e-2


@pytest.mark.parametrize("tie", [False, True])
def test_head_returns_loss_sum_and_count_of_counted_tokens(tie):
    cfg = dataclasses.replace(CFG, tie_embeddings=tie)
    execution = Execution(loss_chunk=4, loss_vocab_chunk=16)  # ragged chunks of both
    abstract = nnx.eval_shape(lambda: make_stages(cfg, 0, execution))
    _, head = nnx.merge(nnx.graphdef(abstract), _random_params(abstract, 0))
    x = _normal(6, 2, 9, cfg.hidden_size)
    targets = np.random.default_rng(6).integers(0, cfg.vocab_size, size=(2, 9))
    targets[0, :3] = targets[1, 5] = IGNORE_ID
    loss_sum, count = jax.jit(lambda x, t: head(x, t))(x, jnp.asarray(targets))
    counted = targets != IGNORE_ID
    per_token = optax.softmax_cross_entropy_with_integer_labels(
        head.logits(x), jnp.asarray(np.where(counted, targets, 0)))
    assert float(count) == counted.sum() == 14
    np.testing.assert_allclose(float(loss_sum), float(per_token[counted].mean()) * 14, rtol=1e-5)


@pytest.mark.parametrize("change,key", [
    (dict(attention="auto"), "train.attention"), (dict(attention_block=0), "train.attention_block"),
    (dict(tile_size=-1), "train.tile_size"), (dict(loss_chunk=0), "train.loss_chunk"),
    (dict(loss_vocab_chunk=-4), "train.loss_vocab_chunk")])
def test_execution_refuses_bad_settings_naming_the_key(change, key):
    with pytest.raises(ValueError, match=key):
        Execution(**change)
