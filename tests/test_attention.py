"""Attention: blockwise equals the dense reference (values and gradients), skips what the mask rules
out, stays linear in T; cuDNN's window mapping and the implementation choice."""

import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from megatrain_jax.attention import (
    attention,
    block_schedule,
    blockwise_attention,
    choose_attention,
    cudnn_attention,
    local_window_size_of,
    reference_attention,
)


def _qkvr(B, T, N, K, H, dtype=jnp.float32, seed=0):
    """q, k, v and a random cotangent r for the output (numpy draws: nothing to compile)."""
    rng = np.random.default_rng(seed)
    draw = lambda *shape: jnp.asarray(rng.standard_normal(shape).astype(dtype))
    return draw(B, T, N, H), draw(B, T, K, H), draw(B, T, K, H), draw(B, T, N, H)


@functools.partial(jax.jit, static_argnums=0)
def _out_and_grads(fn, q, k, v, r):
    """fn(q, k, v) and the gradients of sum(fn(q, k, v) * r) w.r.t. q, k, v, in one compile."""
    out, vjp = jax.vjp(fn, q, k, v)
    return out, vjp(r.astype(out.dtype))


def _assert_close(actual, expected, rtol):
    # Relative to the array's scale (at least 1): gradients hold near-zero entries, and with window=1
    # dq is exactly zero in the reference but rounding noise in the blockwise backward.
    actual, expected = np.asarray(actual, np.float32), np.asarray(expected, np.float32)
    np.testing.assert_allclose(actual, expected, rtol=0, atol=rtol * max(np.abs(expected).max(), 1.0))


def _segments(B, T, seed):
    """(B, T) int32 packed-document ids, several documents per row, different per row."""
    rng = np.random.default_rng(seed)
    starts = np.zeros((B, T), bool)
    for b in range(B):
        starts[b, rng.choice(np.arange(1, T), size=3 + b, replace=False)] = True
    return jnp.asarray(np.cumsum(starts, axis=1), jnp.int32)


# Each case covers a shape or mask the others do not; segments without a window are in
# test_fully_masked_block_rows_are_finite, and which blocks each window needs in
# test_block_ranges_are_exactly_the_blocks_the_mask_needs.
CASES = {
    "mha_block_over_T": dict(T=20, N=4, K=4, block_size=64),
    "gqa_k2": dict(T=32, N=4, K=2, block_size=8),
    "mqa_ragged_T": dict(T=37, N=4, K=1, block_size=8),
    "window_1": dict(T=32, N=4, K=2, block_size=8, window=1),
    "window_5": dict(T=32, N=4, K=2, block_size=8, window=5),  # not a multiple of the block
    "window_segments": dict(T=37, N=4, K=2, block_size=8, window=11, segments=True),
    "window_scale": dict(T=32, N=4, K=2, block_size=8, window=5, scale=0.2),  # Gemma's query scale
}


@pytest.mark.parametrize("name", CASES)
def test_blockwise_matches_reference(name):
    case = CASES[name]
    T, N, K, block_size = case["T"], case["N"], case["K"], case["block_size"]
    window = case.get("window", 0)
    q, k, v, r = _qkvr(2, T, N, K, 16)
    seg = _segments(2, T, seed=T) if case.get("segments") else None
    masks = dict(segment_ids=seg, window=window, scale=case.get("scale"))
    blockwise = functools.partial(blockwise_attention, **masks, block_size=block_size)
    out, grads = _out_and_grads(blockwise, q, k, v, r)
    ref_out, ref_grads = _out_and_grads(functools.partial(reference_attention, **masks), q, k, v, r)
    _assert_close(out, ref_out, 1e-5)
    for g, ref_g in zip(grads, ref_grads):
        _assert_close(g, ref_g, 1e-5)


def test_blockwise_bf16_close_to_fp32_reference():
    q, k, v, r = _qkvr(2, 40, 4, 2, 16, dtype=jnp.bfloat16)
    r = r.astype(jnp.float32)  # bf16 values, so both sides get the same cotangent
    out, grads = _out_and_grads(functools.partial(blockwise_attention, window=12, block_size=8), q, k, v, r)
    up = lambda x: x.astype(jnp.float32)
    reference_fp32 = lambda q, k, v: reference_attention(up(q), up(k), up(v), window=12)
    ref_out, ref_grads = _out_and_grads(reference_fp32, q, k, v, r)
    assert out.dtype == jnp.bfloat16 and all(g.dtype == jnp.bfloat16 for g in grads)
    _assert_close(out, ref_out, 2e-2)
    for g, ref_g in zip(grads, ref_grads):
        _assert_close(g, ref_g, 3e-2)


def test_fully_masked_block_rows_are_finite():
    # Document 0 is key block 0 exactly: every later query block visits it (causal allows it)
    # and finds every one of its rows masked; it is the first key block they visit.
    T, block_size = 16, 4
    seg = jnp.asarray(np.repeat([[0, 1, 1, 2]], block_size, axis=1).repeat(2, axis=0), jnp.int32)
    q, k, v, r = _qkvr(2, T, 4, 2, 8)
    blockwise = functools.partial(blockwise_attention, segment_ids=seg, block_size=block_size)
    out, grads = _out_and_grads(blockwise, q, k, v, r)
    ref_out, ref_grads = _out_and_grads(functools.partial(reference_attention, segment_ids=seg), q, k, v, r)
    for x in (out, *grads):
        assert np.isfinite(np.asarray(x)).all()
    _assert_close(out, ref_out, 1e-5)
    for g, ref_g in zip(grads, ref_grads):
        _assert_close(g, ref_g, 1e-5)


@pytest.mark.parametrize("T,block_size,window",
                         [(32, 8, 0), (37, 8, 0), (48, 8, 5), (48, 8, 8), (37, 8, 11), (20, 4, 1),
                          (48, 8, 60)])
def test_the_schedule_visits_exactly_the_blocks_the_mask_needs(T, block_size, window):
    nb = -(-T // block_size)
    i, j = np.arange(T)[:, None], np.arange(T)[None, :]
    allowed = (j <= i) & ((i - j < window) if window else True)
    needed = {(a // block_size, b // block_size) for a, b in zip(*np.nonzero(allowed))}
    steps = block_schedule(range(nb), block_size=block_size, window=window, key_blocks=nb)
    visited = [(r, j) for r, j in steps if j >= 0]
    assert set(visited) == needed and len(visited) == len(needed)  # each once
    assert len(needed) < nb * nb  # something is skipped
    # steps masked out whole: only where a window reaches before the sequence
    assert len(steps) - len(visited) <= (window // block_size + 1) ** 2


@pytest.mark.parametrize("window", [0, 5, 20])
def test_two_query_tiles_from_either_end_take_a_static_number_of_steps(window):
    """Tiles t and n - 1 - t of a sequence of n tiles together take as many steps whatever t
    is: the tiled block's loop over such pairs has a trip count known when it is traced."""
    n, per_tile, bs = 6, 3, 4
    rows = lambda tiles: [t * per_tile + r for t in tiles for r in range(per_tile)]
    steps = {len(block_schedule(rows((t, n - 1 - t)), block_size=bs, window=window,
                                key_blocks=n * per_tile)) for t in range(n // 2)}
    assert len(steps) == 1, steps
    # a tile alone does not (causally): the first tile takes fewer steps than the last
    alone = [len(block_schedule(rows((t,)), block_size=bs, window=window,
                                key_blocks=n * per_tile)) for t in (0, n - 1)]
    assert (alone[0] < alone[1]) == (window == 0 or window > n * per_tile * bs), alone


def _poison(x, block, block_size):
    x = np.array(x)
    x[:, block * block_size:(block + 1) * block_size] = np.nan
    return jnp.asarray(x)


@pytest.mark.parametrize("window", [0, 5])
def test_blockwise_visits_no_skipped_block(window):
    # NaN in a block that must be skipped: visiting it, even fully masked, spreads the NaN through
    # 0 * NaN in the matmuls, so the outputs and gradients that must not depend on it stay finite
    # only if the forward and backward loops really skip it.
    T, bs = 48, 8
    q, k, v, r = _qkvr(1, T, 4, 2, 8)
    attn = jax.jit(lambda q, k, v: blockwise_attention(q, k, v, window=window, block_size=bs))
    # Forward and dq: key block 5 (causal) or key block 0 (window 5: query blocks >= 2 are past it).
    kblock, rows = (5, slice(0, 5 * bs)) if window == 0 else (0, slice(2 * bs, T))
    out, vjp = jax.vjp(attn, q, _poison(k, kblock, bs), _poison(v, kblock, bs))
    dq = vjp(r)[0]
    assert np.isfinite(np.asarray(out[:, rows])).all() and np.isfinite(np.asarray(dq[:, rows])).all()
    assert np.isnan(np.asarray(out)).any()  # the poison is reachable where the mask allows it
    # dk, dv: query block 0 (causal: key blocks >= 1 never see it) or 5 (window 5: key blocks < 4).
    qblock, rows = (0, slice(bs, T)) if window == 0 else (5, slice(0, 4 * bs))
    _, vjp = jax.vjp(attn, _poison(q, qblock, bs), k, v)
    _, dk, dv = vjp(r)
    assert np.isfinite(np.asarray(dk[:, rows])).all() and np.isfinite(np.asarray(dv[:, rows])).all()
    assert np.isnan(np.asarray(dk)).any()


def _temp_bytes(fn, T):
    q = jax.ShapeDtypeStruct((1, T, 2, 16), jnp.float32)
    kv = jax.ShapeDtypeStruct((1, T, 1, 16), jnp.float32)
    loss = lambda q, k, v, r: jnp.sum(fn(q, k, v) * r)
    compiled = jax.jit(jax.value_and_grad(loss, argnums=(0, 1, 2))).lower(q, kv, kv, q).compile()
    return compiled.memory_analysis().temp_size_in_bytes


def test_blockwise_memory_is_linear_in_T_and_the_reference_is_not():
    blockwise = lambda q, k, v: blockwise_attention(q, k, v, block_size=256)
    blockwise_ratio = _temp_bytes(blockwise, 8192) / _temp_bytes(blockwise, 2048)
    reference_ratio = _temp_bytes(reference_attention, 8192) / _temp_bytes(reference_attention, 2048)
    assert blockwise_ratio <= 4.5, blockwise_ratio
    assert reference_ratio >= 12, reference_ratio  # ~16: the (B, N, T, T) scores


@pytest.mark.parametrize("window", [1, 4, 9])
def test_cudnn_window_mapping_means_hf_window(window):
    # cuDNN cannot run here; XLA's implementation reads the same (left, right) window.
    q, k, v, _ = _qkvr(1, 24, 4, 2, 8)
    xla = jax.jit(functools.partial(jax.nn.dot_product_attention, is_causal=True,
                                    local_window_size=local_window_size_of(window), implementation="xla"))
    reference = jax.jit(functools.partial(reference_attention, window=window))
    _assert_close(xla(q, k, v), reference(q, k, v), 1e-5)
    assert local_window_size_of(0) is None


def test_cudnn_attention_refuses_segments():
    q, k, v, _ = _qkvr(1, 8, 2, 2, 8, dtype=jnp.bfloat16)
    with pytest.raises(ValueError, match="segment"):
        cudnn_attention(q, k, v, segment_ids=jnp.zeros((1, 8), jnp.int32))


def test_attention_dispatch():
    q, k, v, _ = _qkvr(1, 20, 4, 2, 8)
    seg = _segments(1, 20, seed=1)
    run = lambda **kw: jax.jit(functools.partial(attention, segment_ids=seg, window=6, **kw))(q, k, v)
    ref = jax.jit(functools.partial(reference_attention, segment_ids=seg, window=6))(q, k, v)
    np.testing.assert_array_equal(run(implementation="xla"), ref)
    _assert_close(run(implementation="blockwise", block_size=8), ref, 1e-5)
    with pytest.raises(ValueError, match="choose_attention"):
        attention(q, k, v, implementation="auto")


GPU_OK = dict(platform="gpu", dtype=jnp.bfloat16, head_dim=128, document_mask=False)
MEASURED = {"blockwise/512": 9.0, "blockwise/1024": 6.0, "blockwise/2048": 5.0, "merged": 3.0,
            "untiled": 2.5}


@pytest.mark.parametrize("change,reason", [
    (dict(platform="cpu"), "not a GPU"),
    (dict(document_mask=True), "document masks"),
    (dict(dtype=jnp.float32), "bf16/fp16, got float32"),
    (dict(head_dim=100), "multiple of 8"),
    (dict(head_dim=264), "<= 256"),
])
def test_where_cudnn_cannot_run_blockwise_does_and_an_asked_for_cudnn_says_so(change, reason):
    choice = choose_attention("auto", **{**GPU_OK, **change}, measured=MEASURED)
    assert (choice.attention, choice.tiled) == ("blockwise", "blockwise")
    assert reason in choice.reason and "\n" not in choice.reason and not choice.notice
    assert choice.block == 2048  # the fastest measured block that divides the tile
    asked = choose_attention("cudnn", **{**GPU_OK, **change}, tile=8192)
    assert (asked.attention, asked.tiled) == ("blockwise", "blockwise")
    assert asked.notice == (f"train.attention=cudnn cannot run here ({asked.reason.split(';')[0]}): "
                            f"blockwise attention runs instead")
    assert reason in asked.notice and "\n" not in asked.notice


def test_under_tiles_the_fastest_measured_candidate_that_can_run_is_chosen():
    choose = lambda measured, **kw: choose_attention("auto", **{**GPU_OK, "tile": 8192, **kw},
                                                     measured=measured)
    assert (choose(MEASURED).attention, choose(MEASURED).tiled) == ("cudnn", "untiled")
    without = {k: v for k, v in MEASURED.items() if k != "untiled"}
    assert choose(without).tiled == "merged"
    assert choose(without, windowed=True).tiled == "blockwise"  # cuDNN's merge takes no window
    assert choose(without, windowed=True).block == 2048
    assert choose(MEASURED, block=512).block == 512  # a block asked for is kept
    assert choose({"blockwise/512": 9.0, "blockwise/2048": 5.0}, tile=1536).block == 512
    fastest = choose(MEASURED)
    assert "fastest measured on gpu: untiled 2.5 s, merged 3 s, blockwise/2048 5 s" in fastest.reason


def test_with_nothing_measured_the_choice_stays_blockwise_per_tile_and_says_so():
    auto = choose_attention("auto", **GPU_OK, tile=8192, measured={})
    assert (auto.attention, auto.tiled, auto.block) == ("cudnn", "blockwise", 512)
    assert "nothing measured on gpu" in auto.reason
    cudnn = choose_attention("cudnn", **GPU_OK, tile=8192, measured={})
    assert (cudnn.attention, cudnn.tiled) == ("cudnn", "untiled")  # asked for cuDNN: it runs
    xla = choose_attention("xla", **GPU_OK, tile=8192, measured=MEASURED)
    assert (xla.attention, xla.tiled) == ("xla", "untiled")
    cpu = choose_attention("blockwise", platform="cpu", dtype=jnp.float32, head_dim=100,
                           document_mask=True)
    assert (cpu.attention, cpu.tiled, cpu.block) == ("blockwise", "blockwise", 512)
    with pytest.raises(ValueError, match="train.attention"):
        choose_attention("flash", **GPU_OK)
