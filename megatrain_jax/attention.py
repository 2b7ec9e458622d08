"""Causal self-attention of a decoder: a blockwise (flash) path in plain JAX, cuDNN, a dense reference.

Shapes use the letters B batch, T sequence, N query heads, K kv heads (N % K == 0), G = N // K
query heads per kv head, H head dim, and for one block pair Q query rows and S key rows.
q is (B, T, N, H), k and v are (B, T, K, H); query head n reads kv head n // G, as in HF.

Masks, all with Hugging Face semantics: query i attends key j iff j <= i, and i - j < window when
window > 0 (Mistral/Qwen2 sliding window; window=1 is "only itself"), and
segment_ids[b, i] == segment_ids[b, j] when segment ids are given (packed documents).

`blockwise_attention` never builds a T x T array: the forward is an online softmax over key blocks
and the backward (a custom VJP) recomputes probabilities block by block from the saved fp32
logsumexp, as FlashAttention-2 does. Block pairs the causal mask and the window rule out entirely
are never visited, so its work is ~T^2/2 without a window and ~T*window with one.
"""

import dataclasses
import functools

import jax
import jax.numpy as jnp
from jax import lax

IMPLEMENTATIONS = ("auto", "cudnn", "blockwise", "xla")

# Finite, so that a row with no visible key in one block gives exp(NEG - NEG) = 1 rather than
# exp(-inf + inf) = NaN; the explicit `where` on the probabilities then zeroes it.
_NEG = -1e30


# -----------------------------------------------------------------------------
# which blocks a block needs


def key_block_range(q_block, *, block_size: int, window: int, q_start=0):
    """[start, stop) of the key blocks query block `q_block` must visit (ints or traced ints), the
    queries' first position being q_start (any integer: a tile of a longer sequence)."""
    first = q_start + q_block * block_size
    stop = (first + block_size - 1) // block_size + 1  # causal: nothing after its last query
    if window == 0:
        return 0, stop
    # The block's first query reaches back to key first - (window - 1).
    return jnp.maximum(0, (first - window + 1) // block_size), stop


def query_block_range(k_block, *, block_size: int, window: int, num_blocks: int, q_start=0):
    """[start, stop) of the query blocks (num_blocks of them, from position q_start) that see any
    key of key block `k_block`."""
    first_key = k_block * block_size
    start = jnp.maximum(0, (first_key - q_start) // block_size)
    if window == 0:
        return start, num_blocks
    # The block's last key is seen up to query first_key + block_size - 1 + window - 1.
    last = (first_key + block_size + window - 2 - q_start) // block_size
    return start, jnp.minimum(num_blocks, last + 1)


def _block_mask(q_block, k_block, seg_q, seg_k, *, block_size: int, window: int, seq_len: int,
                q_start=0):
    """(B or 1, 1, 1, Q, S) bool: which (query, key) pairs of one block pair may attend."""
    q_pos = q_start + q_block * block_size + jnp.arange(block_size)[:, None]  # (Q, 1)
    k_pos = k_block * block_size + jnp.arange(block_size)[None, :]  # (1, S)
    # Padded query rows see nothing (their output is discarded, their cotangent is zero).
    mask = (k_pos <= q_pos) & (q_pos < seq_len)  # (Q, S); k <= q < T also rules out padded keys
    if window:
        mask &= q_pos - k_pos < window
    mask = mask[None]  # (1, Q, S)
    if seg_q is not None:
        mask = mask & (seg_q[:, :, None] == seg_k[:, None, :])  # (B, Q, S), from the two blocks' ids
    return mask[:, None, None]


# -----------------------------------------------------------------------------
# blockwise (flash) attention
#
# The kernels take queries at positions q_start .. q_start + Tq - 1 (a tile of the sequence, or
# all of it) against keys and values of positions 0 .. Tk - 1, so that a block tiled over the
# sequence (megatrain_jax/seqtile.py) attends one query tile at a time to the whole K and V.


def _to_blocks(x, num_blocks: int, block_size: int):
    """(B, T, ...) -> (B, num_blocks, block_size, ...), zero-padded at the end."""
    pad = num_blocks * block_size - x.shape[1]
    x = jnp.pad(x, [(0, 0), (0, pad)] + [(0, 0)] * (x.ndim - 2))
    return x.reshape(x.shape[0], num_blocks, block_size, *x.shape[2:])


def _block(x, i):
    """Block i of a (B, num_blocks, ...) array, as (B, ...)."""
    return lax.dynamic_index_in_dim(x, i, axis=1, keepdims=False)


def _einsum32(spec: str, a, b):
    """einsum with fp32 accumulation and result, whatever the operands' dtype."""
    return jnp.einsum(spec, a, b, preferred_element_type=jnp.float32)


@dataclasses.dataclass(frozen=True)
class _Span:
    """Where a call's queries sit: from position q_start (int or traced) in a sequence of seq_len
    tokens (query rows at or after it see nothing), with the static mask and block options."""
    q_start: object
    seq_len: int
    window: int
    block_size: int
    scale: float

    def blocks(self, tokens: int) -> int:
        return -(-tokens // self.block_size)

    def mask(self, i, j, seg_q, seg_k):
        return _block_mask(i, j, seg_q, seg_k, block_size=self.block_size, window=self.window,
                           seq_len=self.seq_len, q_start=self.q_start)


def _segment_blocks(seg, num_blocks: int, block_size: int):
    return None if seg is None else _to_blocks(seg, num_blocks, block_size)


def _flash_forward(q, k, v, seg_q, seg_k, span: _Span):
    """(o (B, Tq, N, H) in q.dtype, lse (B, N, Tq) fp32)."""
    B, T, N, H = q.shape
    K = k.shape[2]
    G = N // K
    bs = span.block_size
    nb, nk = span.blocks(T), span.blocks(k.shape[1])
    qb = _to_blocks(q.reshape(B, T, K, G, H), nb, bs)  # (B, nb, Q, K, G, H)
    kb = _to_blocks(k, nk, bs)  # (B, nk, S, K, H)
    vb = _to_blocks(v, nk, bs)
    seg_qb, seg_kb = _segment_blocks(seg_q, nb, bs), _segment_blocks(seg_k, nk, bs)  # (B, n, Q)

    def query_block(i):
        q_i = _block(qb, i)  # (B, Q, K, G, H)
        seg_i = None if seg_qb is None else _block(seg_qb, i)

        def visit_key_block(j, carry):
            m, l, acc = carry  # (B, K, G, Q), (B, K, G, Q), (B, K, G, Q, H), fp32
            s = _einsum32("bqkgh,bskh->bkgqs", q_i, _block(kb, j)) * span.scale
            mask = span.mask(i, j, seg_i, None if seg_kb is None else _block(seg_kb, j))
            s = jnp.where(mask, s, _NEG)
            m_new = jnp.maximum(m, s.max(-1))
            p = jnp.where(mask, jnp.exp(s - m_new[..., None]), 0.0)  # (B, K, G, Q, S)
            alpha = jnp.exp(m - m_new)
            l = alpha * l + p.sum(-1)
            pv = _einsum32("bkgqs,bskh->bkgqh", p.astype(v.dtype), _block(vb, j))
            return m_new, l, alpha[..., None] * acc + pv

        init = (jnp.full((B, K, G, bs), _NEG, jnp.float32),
                jnp.zeros((B, K, G, bs), jnp.float32),
                jnp.zeros((B, K, G, bs, H), jnp.float32))
        start, stop = key_block_range(i, block_size=bs, window=span.window, q_start=span.q_start)
        m, l, acc = lax.fori_loop(start, jnp.minimum(stop, nk), visit_key_block, init)
        l = jnp.where(l > 0, l, 1.0)  # only padded query rows see no key at all
        return (acc / l[..., None]).astype(q.dtype), m + jnp.log(l)

    o, lse = lax.map(query_block, jnp.arange(nb))  # (nb, B, K, G, Q, H), (nb, B, K, G, Q)
    o = o.transpose(1, 0, 4, 2, 3, 5).reshape(B, nb * bs, N, H)[:, :T]
    lse = lse.transpose(1, 2, 3, 0, 4).reshape(B, N, nb * bs)[:, :, :T]
    return o, lse


def _flash_backward(q, k, v, seg_q, seg_k, o, lse, do, dk, dv, span: _Span):
    """(dq in q.dtype, dk + these queries' share, dv + theirs): FlashAttention-2's backward, key
    blocks outermost; dk and dv are fp32 accumulators (B, nk, S, K, H) over k's blocks."""
    B, T, N, H = q.shape
    K = k.shape[2]
    G = N // K
    bs = span.block_size
    nb, nk = span.blocks(T), span.blocks(k.shape[1])
    # D_i = rowsum(do_i * o_i) = sum_j p_ij dp_ij: the softmax backward's per-row term.
    delta = _einsum32("btnh,btnh->bnt", do.astype(jnp.float32), o.astype(jnp.float32))  # (B, N, T)

    def rows_to_blocks(x):  # (B, N, T) -> (B, nb, K, G, Q)
        x = _to_blocks(x.transpose(0, 2, 1), nb, bs)  # (B, nb, Q, N)
        return x.reshape(B, nb, bs, K, G).transpose(0, 1, 3, 4, 2)

    qb = _to_blocks(q.reshape(B, T, K, G, H), nb, bs)  # (B, nb, Q, K, G, H)
    dob = _to_blocks(do.reshape(B, T, K, G, H), nb, bs)  # zero on padded rows
    kb = _to_blocks(k, nk, bs)  # (B, nk, S, K, H)
    vb = _to_blocks(v, nk, bs)
    lseb, deltab = rows_to_blocks(lse), rows_to_blocks(delta)  # (B, nb, K, G, Q)
    seg_qb, seg_kb = _segment_blocks(seg_q, nb, bs), _segment_blocks(seg_k, nk, bs)

    def key_block(j, carry):
        dq, dk, dv = carry  # (B, nb, Q, K, G, H), (B, nk, S, K, H), (B, nk, S, K, H), fp32
        k_j, v_j = _block(kb, j), _block(vb, j)  # (B, S, K, H)
        seg_j = None if seg_kb is None else _block(seg_kb, j)

        def visit_query_block(i, carry):
            dq, dk_j, dv_j = carry  # (B, nb, Q, K, G, H), (B, S, K, H), (B, S, K, H), fp32
            q_i, do_i = _block(qb, i), _block(dob, i)  # (B, Q, K, G, H)
            s = _einsum32("bqkgh,bskh->bkgqs", q_i, k_j) * span.scale
            mask = span.mask(i, j, None if seg_qb is None else _block(seg_qb, i), seg_j)
            p = jnp.where(mask, jnp.exp(s - _block(lseb, i)[..., None]), 0.0)  # (B, K, G, Q, S)
            dv_j += _einsum32("bkgqs,bqkgh->bskh", p.astype(do.dtype), do_i)
            dp = _einsum32("bqkgh,bskh->bkgqs", do_i, v_j)
            ds = p * (dp - _block(deltab, i)[..., None]) * span.scale  # (B, K, G, Q, S)
            dq_i = _einsum32("bkgqs,bskh->bqkgh", ds.astype(k.dtype), k_j)
            dq = lax.dynamic_update_index_in_dim(dq, _block(dq, i) + dq_i, i, axis=1)
            dk_j += _einsum32("bkgqs,bqkgh->bskh", ds.astype(q.dtype), q_i)
            return dq, dk_j, dv_j

        start, stop = query_block_range(j, block_size=bs, window=span.window, num_blocks=nb,
                                        q_start=span.q_start)
        dq, dk_j, dv_j = lax.fori_loop(start, stop, visit_query_block,
                                       (dq, _block(dk, j), _block(dv, j)))
        put = lambda acc, x: lax.dynamic_update_index_in_dim(acc, x, j, axis=1)
        return dq, put(dk, dk_j), put(dv, dv_j)

    # dq gathers from every key block, so it is carried whole (fp32, O(Tq)); so are dk and dv,
    # each key block's rows updated in place. Only the key blocks these queries see are visited.
    first = key_block_range(0, block_size=bs, window=span.window, q_start=span.q_start)[0]
    last = key_block_range(nb - 1, block_size=bs, window=span.window, q_start=span.q_start)[1]
    dq0 = jnp.zeros((B, nb, bs, K, G, H), jnp.float32)
    dq, dk, dv = lax.fori_loop(first, jnp.minimum(last, nk), key_block, (dq0, dk, dv))
    return dq.reshape(B, nb * bs, N, H)[:, :T].astype(q.dtype), dk, dv


def _key_accumulator(k, block_size: int):
    """Zeros (B, nk, S, K, H) fp32: dk or dv over k's blocks."""
    nk = -(-k.shape[1] // block_size)
    return jnp.zeros((k.shape[0], nk, block_size, *k.shape[2:]), jnp.float32)


def _from_key_blocks(acc, like):
    """A (B, nk, S, K, H) accumulator as `like`'s (B, Tk, K, H) shape and dtype."""
    B, T = like.shape[:2]
    return acc.reshape(B, -1, *like.shape[2:])[:, :T].astype(like.dtype)


@functools.partial(jax.custom_vjp, nondiff_argnums=(4,))
def _flash(q, k, v, segment_ids, span):
    return _flash_forward(q, k, v, segment_ids, segment_ids, span)[0]


def _flash_fwd(q, k, v, segment_ids, span):
    o, lse = _flash_forward(q, k, v, segment_ids, segment_ids, span)
    return o, (q, k, v, segment_ids, o, lse)


def _flash_bwd(span, residuals, do):
    q, k, v, segment_ids, o, lse = residuals
    with jax.named_scope("blockwise_attention_bwd"):  # traced apart from the forward's scope
        zeros = _key_accumulator(k, span.block_size)
        dq, dk, dv = _flash_backward(q, k, v, segment_ids, segment_ids, o, lse, do, zeros, zeros,
                                     span)
    return dq, _from_key_blocks(dk, k), _from_key_blocks(dv, v), None  # ids get no cotangent


_flash.defvjp(_flash_fwd, _flash_bwd)


# -----------------------------------------------------------------------------
# one query tile against the whole sequence's keys (the block tiled over the sequence)


@dataclasses.dataclass(frozen=True)
class TileAttention:
    """Attention of one query tile (B, tile, N, H) at positions q_start .. q_start + tile - 1 to
    the keys and values of positions 0 .. Tk - 1 (B, Tk, K, H): the forward and, for a custom
    backward, its parts. Rows at or after seq_len (padding) see nothing. `window` is static."""
    seq_len: int
    window: int
    block_size: int
    scale: float | None = None

    def _span(self, q, q_start) -> _Span:
        return _Span(q_start, self.seq_len, self.window, self.block_size,
                     q.shape[3]**-0.5 if self.scale is None else self.scale)

    def forward(self, q, k, v, seg_q, seg_k, q_start):
        """(o (B, tile, N, H) in q.dtype, lse (B, N, tile) fp32); seg_q (B, tile) and seg_k
        (B, Tk) are the document ids (None: none)."""
        with jax.named_scope("tile_attention"):
            return _flash_forward(q, k, v, seg_q, seg_k, self._span(q, q_start))

    def key_accumulator(self, k):
        """Zeros for `backward`'s dk (or dv) over the whole sequence's keys."""
        return _key_accumulator(k, self.block_size)

    def backward(self, q, k, v, seg_q, seg_k, q_start, o, lse, do, dk, dv):
        """(dq, dk, dv): dk and dv (key_accumulator's) plus this tile's share."""
        with jax.named_scope("tile_attention_bwd"):
            return _flash_backward(q, k, v, seg_q, seg_k, o, lse, do, dk, dv,
                                   self._span(q, q_start))

    def keys(self, acc, like, start: int, size: int):
        """Rows start .. start + size - 1 of an accumulator, as `like`'s dtype (B, size, K, H)."""
        rows = acc.reshape(acc.shape[0], -1, *acc.shape[3:])
        return lax.dynamic_slice_in_dim(rows, start, size, axis=1).astype(like.dtype)


def _check_shapes(q, k, v, segment_ids, window: int):
    same_bth = q.ndim == k.ndim == 4 and (q.shape[:2], q.shape[3]) == (k.shape[:2], k.shape[3])
    if not same_bth or v.shape != k.shape:
        raise ValueError(f"attention wants q (B, T, N, H) and k, v (B, T, K, H); "
                         f"got {q.shape}, {k.shape}, {v.shape}")
    if q.shape[2] % k.shape[2]:
        raise ValueError(f"query heads ({q.shape[2]}) must be a multiple of kv heads ({k.shape[2]})")
    if segment_ids is not None and segment_ids.shape != q.shape[:2]:
        raise ValueError(f"segment_ids must be (B, T) = {q.shape[:2]}, got {segment_ids.shape}")
    if window < 0:
        raise ValueError(f"window must be >= 0 (0 = no sliding window), got {window}")


def blockwise_attention(q, k, v, *, segment_ids=None, window: int = 0, block_size: int = 512,
                        scale: float | None = None):
    """Causal flash attention in plain JAX: memory linear in T, masked-out block pairs skipped.

    q (B, T, N, H), k and v (B, T, K, H), segment_ids (B, T) int or None; returns (B, T, N, H) in
    q.dtype. Scores are q.k * scale (None: H**-0.5). `window`, `block_size` and `scale` are
    static; T need not be a multiple of block_size.
    """
    _check_shapes(q, k, v, segment_ids, window)
    if block_size < 1:
        raise ValueError(f"block_size must be >= 1, got {block_size}")
    with jax.named_scope("blockwise_attention"):
        T = q.shape[1]
        return _flash(q, k, v, segment_ids,
                      _Span(0, T, window, min(block_size, T), q.shape[3]**-0.5 if scale is None
                            else scale))


# -----------------------------------------------------------------------------
# dense reference and cuDNN


def reference_attention(q, k, v, *, segment_ids=None, window: int = 0, scale: float | None = None):
    """Dense causal attention with the full (B, T, T) mask and an fp32 softmax; O(T^2) memory."""
    _check_shapes(q, k, v, segment_ids, window)
    with jax.named_scope("reference_attention"):
        B, T, N, H = q.shape
        G = N // k.shape[2]
        k, v = jnp.repeat(k, G, axis=2), jnp.repeat(v, G, axis=2)  # (B, T, N, H): head n reads n // G
        i, j = jnp.arange(T)[:, None], jnp.arange(T)[None, :]
        mask = (j <= i)[None]  # (1, T, T)
        if window:
            mask = mask & (i - j < window)
        if segment_ids is not None:
            mask = mask & (segment_ids[:, :, None] == segment_ids[:, None, :])  # (B, T, T)
        s = _einsum32("btnh,bsnh->bnts", q, k) * (H**-0.5 if scale is None else scale)
        p = jax.nn.softmax(jnp.where(mask[:, None], s, _NEG), axis=-1)  # (B, N, T, T)
        return _einsum32("bnts,bsnh->btnh", p, v.astype(jnp.float32)).astype(q.dtype)


def cached_attention(q, k_cache, v_cache, position, *, window=0, scale: float | None = None):
    """Attention of new queries against a KV cache, for generation: q (B, T, N, H) at positions
    position .. position + T - 1, k_cache and v_cache (B, S, K, H) holding the keys and values of
    positions 0 .. S - 1 (those after the queries' are ignored). Query at p sees key j iff j <= p
    and, when window > 0, p - j < window, as in the causal attentions above; `position` and
    `window` may be traced (one compiled function for every position and both kinds of a Gemma 3
    layer). Dense over S with an fp32 softmax: (B, N, T, S) scores, small for one new token."""
    B, T, N, H = q.shape
    S, K = k_cache.shape[1], k_cache.shape[2]
    G = N // K
    with jax.named_scope("cached_attention"):
        p = position + jnp.arange(T)[:, None]  # (T, 1)
        j = jnp.arange(S)[None, :]  # (1, S)
        mask = (j <= p) & ((window <= 0) | (p - j < window))  # (T, S)
        qg = q.reshape(B, T, K, G, H)
        s = _einsum32("btkgh,bskh->bkgts", qg, k_cache) * (H**-0.5 if scale is None else scale)
        probs = jax.nn.softmax(jnp.where(mask, s, _NEG), axis=-1)  # (B, K, G, T, S)
        out = _einsum32("bkgts,bskh->btkgh", probs, v_cache.astype(jnp.float32))
        return out.reshape(B, T, N, H).astype(q.dtype)


def local_window_size_of(window: int):
    """HF window W -> `jax.nn.dot_product_attention`'s (left, right) window, or None for none.

    JAX lets query i see keys i - left .. i + right (cuDNN gets sliding_window_length = left + 1,
    i.e. keys in (i - W, i]); HF's i - j < W is therefore left = W - 1, right = 0.
    """
    return (window - 1, 0) if window else None


def cudnn_attention(q, k, v, *, segment_ids=None, window: int = 0, scale: float | None = None):
    """Causal cuDNN flash attention via `jax.nn.dot_product_attention` (GPU, bf16/fp16 only).

    Raises ValueError for segment ids: the public API only takes them as a dense T x T mask.
    """
    if segment_ids is not None:
        raise ValueError("cudnn attention does not support segment ids (document masks): the public "
                         "cuDNN API would need a dense T x T mask; use blockwise attention")
    _check_shapes(q, k, v, segment_ids, window)
    with jax.named_scope("cudnn_attention"):
        return jax.nn.dot_product_attention(q, k, v, is_causal=True, implementation="cudnn",
                                            scale=scale,
                                            local_window_size=local_window_size_of(window))


# -----------------------------------------------------------------------------
# choosing and dispatching


def _cudnn_unsupported(*, platform: str, dtype, head_dim: int, document_mask: bool) -> str:
    """Why cuDNN cannot run this attention, or "" if it can."""
    if platform != "gpu":
        return f"not a GPU (platform {platform})"
    if document_mask:
        return "document masks are not supported by cuDNN's public API"
    if jnp.dtype(dtype) not in (jnp.dtype(jnp.bfloat16), jnp.dtype(jnp.float16)):
        return f"cudnn needs bf16/fp16, got {jnp.dtype(dtype).name}"
    # Hopper's limit; before Hopper cuDNN allows only head_dim <= 128 and raises itself.
    if head_dim % 8 or head_dim > 256:
        return f"cudnn needs a head dim that is a multiple of 8 and <= 256, got {head_dim}"
    return ""


def choose_implementation(requested: str, *, platform: str, dtype, head_dim: int, document_mask: bool):
    """(implementation, reason): "auto" becomes "cudnn" where it can run, else "blockwise".

    An explicit "cudnn" that cannot run raises ValueError; "blockwise" and "xla" (the dense
    reference) are taken as asked.
    """
    if requested not in IMPLEMENTATIONS:
        raise ValueError(f"train.attention must be one of {IMPLEMENTATIONS}, got {requested!r}")
    if requested in ("blockwise", "xla"):
        return requested, f"requested {requested}"
    why_not = _cudnn_unsupported(platform=platform, dtype=dtype, head_dim=head_dim,
                                 document_mask=document_mask)
    if requested == "cudnn":
        if why_not:
            raise ValueError(f"train.attention=cudnn cannot run: {why_not}")
        return "cudnn", "requested cudnn"
    if why_not:
        return "blockwise", why_not
    return "cudnn", f"GPU, {jnp.dtype(dtype).name}, head dim {head_dim}, no document mask"


def attention(q, k, v, *, implementation: str, segment_ids=None, window: int = 0, block_size: int = 512,
              scale: float | None = None):
    """Causal self-attention by a resolved implementation: "cudnn", "blockwise" or "xla".
    Scores are q.k * scale, by default H**-0.5 (Gemma's query_pre_attn_scalar**-0.5 differs)."""
    if implementation == "cudnn":
        return cudnn_attention(q, k, v, segment_ids=segment_ids, window=window, scale=scale)
    if implementation == "blockwise":
        return blockwise_attention(q, k, v, segment_ids=segment_ids, window=window,
                                   block_size=block_size, scale=scale)
    if implementation == "xla":
        return reference_attention(q, k, v, segment_ids=segment_ids, window=window, scale=scale)
    raise ValueError(f"attention implementation must be cudnn, blockwise or xla (resolve 'auto' with "
                     f"choose_implementation), got {implementation!r}")
