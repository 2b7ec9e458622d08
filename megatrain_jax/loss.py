"""Cross-entropy for the LM head that never holds the full logits or their gradient.

The dense head builds (tokens, vocab) fp32 logits, and autodiff keeps them plus their gradient:
a 32K-token sequence at V=152K is ~20 GB of logits in fp32, ~40 GB with the gradient.
`chunked_cross_entropy` instead walks over chunks of tokens (and optionally of the vocabulary,
with an online logsumexp), keeping only the per-token fp32 logsumexp for the backward, which a
custom VJP uses to recompute each chunk's softmax. Temporaries are O(chunk x vocab chunk), plus
an fp32 accumulator for the weight gradient.
"""

import functools

import jax
import jax.numpy as jnp
from jax import lax

IGNORE_ID = -100

# Finite stand-in for -inf on masked vocabulary columns: exp(_NEG - m) == 0 without inf - inf.
_NEG = -1e30

# einsum specs per layout: logits, dy = dlogits @ w^T, dw = y^T @ dlogits.
_SPECS = {
    "dv": ("cd,dv->cv", "cv,dv->cd", "cv,cd->dv"),
    "vd": ("cd,vd->cv", "cv,vd->cd", "cv,cd->vd"),
}


def _identity(params, y):
    return y


def chunked_cross_entropy(y, w, targets, *, layout: str = "dv", chunk: int = 4096,
                          vocab_chunk: int = 0, softcap: float = 0.0, prologue=None,
                          prologue_params=()):
    """Summed token cross-entropy of logits y @ w (or y @ w.T for layout "vd") against targets.

    y: (..., D) hidden states; w: (D, V) for layout "dv", (V, D) for "vd" (tied embedding);
    targets: int, shaped like y[..., 0]; tokens with target IGNORE_ID count for nothing.
    chunk: tokens per chunk; vocab_chunk: vocabulary columns per step (0: all at once).
    softcap: the logits are softcap * tanh(logits / softcap) (Gemma's final_logit_softcapping;
    0: off). prologue(prologue_params, y_chunk), if given, maps each chunk of y to the hidden
    states first (per-token math, e.g. the final norm: differentiated too, chunk by chunk, so
    that nothing of y's size but y and its gradient exists). Returns (loss_sum, count), both fp32
    scalars; divide for the mean.
    """
    if layout not in _SPECS:
        raise ValueError(f"layout must be 'dv' or 'vd', got {layout!r}")
    if targets.shape != y.shape[:-1]:
        raise ValueError(f"targets shape {targets.shape} does not match y {y.shape}")
    d = y.shape[-1]
    y = y.reshape(-1, d)
    targets = targets.reshape(-1).astype(jnp.int32)
    count = jnp.sum(targets != IGNORE_ID).astype(jnp.float32)
    n = y.shape[0]
    if n == 0:
        return jnp.zeros((), jnp.float32), count
    c = max(1, min(chunk, n))
    pad = -n % c
    if pad:
        y = jnp.pad(y, ((0, pad), (0, 0)))
        targets = jnp.pad(targets, (0, pad), constant_values=IGNORE_ID)
    return _ce(y, w, prologue_params, targets, prologue or _identity, layout, c, vocab_chunk,
               float(softcap)), count


def _vocab_size(w, layout):
    return w.shape[1] if layout == "dv" else w.shape[0]


def _vocab_plan(w, layout, vocab_chunk):
    """(V, columns per step, steps)."""
    v = _vocab_size(w, layout)
    vc = v if vocab_chunk <= 0 or vocab_chunk >= v else vocab_chunk
    return v, vc, -(-v // vc)


def _vocab_slice(w, layout, j, v, vc):
    """Columns [start, start + vc) of w and a mask of those that step j owns.

    The last step's start is pulled back so the slice stays inside w (no padded copy of w);
    columns it shares with the previous step are masked out.
    """
    start = jnp.minimum(j * vc, v - vc)
    axis = 1 if layout == "dv" else 0
    cols = start + jnp.arange(vc)
    return start, lax.dynamic_slice_in_dim(w, start, vc, axis), cols, cols >= j * vc


def _chunks(x, c):
    return x.reshape(-1, c, *x.shape[1:])


def cap_logits(z, softcap: float):
    """(capped logits, tanh term for the backward, or None): softcap * tanh(z / softcap)."""
    if not softcap:
        return z, None
    t = jnp.tanh(z / softcap)
    return softcap * t, t


def _forward(y, w, pp, targets, prologue, layout, c, vocab_chunk, softcap):
    """Per-token fp32 logsumexp and target logit, each (N,)."""
    v, vc, nv = _vocab_plan(w, layout, vocab_chunk)
    logits_spec = _SPECS[layout][0]
    safe_t = jnp.clip(targets, 0, v - 1)

    def token_chunk(_, xs):
        yc, tc = xs
        yc = prologue(pp, yc)

        def vocab_step(carry, j):
            m, s, zt = carry
            _, wc, cols, own = _vocab_slice(w, layout, j, v, vc)
            z = jnp.einsum(logits_spec, yc, wc, preferred_element_type=jnp.float32)
            z = jnp.where(own, cap_logits(z, softcap)[0], _NEG)
            m_new = jnp.maximum(m, z.max(axis=-1))
            s = s * jnp.exp(m - m_new) + jnp.exp(z - m_new[:, None]).sum(axis=-1)
            zt = zt + jnp.where((cols == tc[:, None]) & own, z, 0.0).sum(axis=-1)
            return (m_new, s, zt), None

        init = (jnp.full((c,), _NEG, jnp.float32), jnp.zeros((c,), jnp.float32), jnp.zeros((c,), jnp.float32))
        (m, s, zt), _ = lax.scan(vocab_step, init, jnp.arange(nv))
        return None, (m + jnp.log(s), zt)

    _, (lse, zt) = lax.scan(token_chunk, None, (_chunks(y, c), _chunks(safe_t, c)))
    return lse.reshape(-1), zt.reshape(-1)


@functools.partial(jax.custom_vjp, nondiff_argnums=(4, 5, 6, 7, 8))
def _ce(y, w, pp, targets, prologue, layout, c, vocab_chunk, softcap):
    return _ce_fwd(y, w, pp, targets, prologue, layout, c, vocab_chunk, softcap)[0]


def _ce_fwd(y, w, pp, targets, prologue, layout, c, vocab_chunk, softcap):
    lse, zt = _forward(y, w, pp, targets, prologue, layout, c, vocab_chunk, softcap)
    loss = jnp.where(targets != IGNORE_ID, lse - zt, 0.0).sum()
    return loss, (y, w, pp, targets, lse)


def _ce_bwd(prologue, layout, c, vocab_chunk, softcap, res, g):
    y, w, pp, targets, lse = res
    # Per-token scale of d loss_sum / d logits; ignored (and padding) tokens get exactly 0.
    scale = jnp.where(targets != IGNORE_ID, g, 0.0).astype(jnp.float32)
    return _scaled_bwd(prologue, layout, c, vocab_chunk, softcap, y, w, pp, targets, lse, scale)


def _scaled_bwd(prologue, layout, c, vocab_chunk, softcap, y, w, pp, targets, lse, scale):
    """(dy, dw, dpp, None) of sum_t scale[t] * (lse[t] - z[t, target[t]]), chunk by chunk."""
    v, vc, nv = _vocab_plan(w, layout, vocab_chunk)
    logits_spec, dy_spec, dw_spec = _SPECS[layout]
    axis = 1 if layout == "dv" else 0
    safe_t = jnp.clip(targets, 0, v - 1)

    def token_chunk(carry, xs):
        dw, dpp = carry
        yc, tc, lse_c, scale_c = xs
        yc, prologue_vjp = jax.vjp(prologue, pp, yc)

        def vocab_step(carry, j):
            dw, dy = carry
            start, wc, cols, own = _vocab_slice(w, layout, j, v, vc)
            z = jnp.einsum(logits_spec, yc, wc, preferred_element_type=jnp.float32)
            z, t = cap_logits(z, softcap)
            p = jnp.where(own, jnp.exp(z - lse_c[:, None]), 0.0)
            dz = (p - ((cols == tc[:, None]) & own)) * scale_c[:, None]
            if t is not None:  # d(softcap * tanh(z / softcap)) / dz
                dz = dz * (1.0 - t * t)
            # Matmul operands in the model dtype (bf16 tensor cores), accumulation in fp32.
            dy = dy + jnp.einsum(dy_spec, dz.astype(w.dtype), wc, preferred_element_type=jnp.float32)
            dwc = jnp.einsum(dw_spec, dz.astype(yc.dtype), yc, preferred_element_type=jnp.float32)
            dwc = dwc + lax.dynamic_slice_in_dim(dw, start, vc, axis)
            return (lax.dynamic_update_slice_in_dim(dw, dwc, start, axis), dy), None

        (dw, dy), _ = lax.scan(vocab_step, (dw, jnp.zeros(yc.shape, jnp.float32)), jnp.arange(nv))
        dpp_c, dy = prologue_vjp(dy.astype(yc.dtype))
        dpp = jax.tree.map(lambda a, g: a + g.astype(jnp.float32), dpp, dpp_c)
        return (dw, dpp), dy.astype(y.dtype)

    xs = (_chunks(y, c), _chunks(safe_t, c), _chunks(lse, c), _chunks(scale, c))
    zeros32 = lambda a: jnp.zeros(a.shape, jnp.float32)
    (dw, dpp), dy = lax.scan(token_chunk, (zeros32(w), jax.tree.map(zeros32, pp)), xs)
    return (dy.reshape(y.shape), dw.astype(w.dtype),
            jax.tree.map(lambda g, p: g.astype(p.dtype), dpp, pp), None)


_ce.defvjp(_ce_fwd, _ce_bwd)


def chunked_token_logprobs(y, w, targets, *, layout: str = "dv", chunk: int = 4096,
                           vocab_chunk: int = 0, softcap: float = 0.0, prologue=None,
                           prologue_params=()):
    """Per-token log-probabilities log p(target | y) of the logits y @ w, shaped like targets
    (0 where the target is IGNORE_ID), with the same chunking and memory bound as
    `chunked_cross_entropy` (whose loss_sum is minus their sum). Differentiable with any per-token
    cotangent: the backward recomputes each chunk's softmax, scaled token by token. For losses
    of whole sequences (a sum per sequence, e.g. preference losses)."""
    if layout not in _SPECS:
        raise ValueError(f"layout must be 'dv' or 'vd', got {layout!r}")
    if targets.shape != y.shape[:-1]:
        raise ValueError(f"targets shape {targets.shape} does not match y {y.shape}")
    shape = targets.shape
    y = y.reshape(-1, y.shape[-1])
    targets = targets.reshape(-1).astype(jnp.int32)
    n = y.shape[0]
    if n == 0:
        return jnp.zeros(shape, jnp.float32)
    c = max(1, min(chunk, n))
    pad = -n % c
    if pad:
        y = jnp.pad(y, ((0, pad), (0, 0)))
        targets = jnp.pad(targets, (0, pad), constant_values=IGNORE_ID)
    nll = _token_ce(y, w, prologue_params, targets, prologue or _identity, layout, c,
                    vocab_chunk, float(softcap))
    return -nll[:n].reshape(shape)


@functools.partial(jax.custom_vjp, nondiff_argnums=(4, 5, 6, 7, 8))
def _token_ce(y, w, pp, targets, prologue, layout, c, vocab_chunk, softcap):
    return _token_ce_fwd(y, w, pp, targets, prologue, layout, c, vocab_chunk, softcap)[0]


def _token_ce_fwd(y, w, pp, targets, prologue, layout, c, vocab_chunk, softcap):
    lse, zt = _forward(y, w, pp, targets, prologue, layout, c, vocab_chunk, softcap)
    return jnp.where(targets != IGNORE_ID, lse - zt, 0.0), (y, w, pp, targets, lse)


def _token_ce_bwd(prologue, layout, c, vocab_chunk, softcap, res, g):
    y, w, pp, targets, lse = res
    scale = jnp.where(targets != IGNORE_ID, g, 0.0).astype(jnp.float32)  # g: (N,)
    return _scaled_bwd(prologue, layout, c, vocab_chunk, softcap, y, w, pp, targets, lse, scale)


_token_ce.defvjp(_token_ce_fwd, _token_ce_bwd)
