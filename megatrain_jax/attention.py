"""Causal self-attention of a decoder: a blockwise (flash) path in plain JAX, cuDNN, a dense reference,
the attentions of a block tiled over the sequence, and the one rule that chooses among them.

Shapes use the letters B batch, T sequence, N query heads, K kv heads (N % K == 0), G = N // K
query heads per kv head, H head dim, and for one block pair Q query rows and S key rows.
q is (B, T, N, H), k and v are (B, T, K, H); query head n reads kv head n // G, as in HF.

Masks, all with Hugging Face semantics: query i attends key j iff j <= i, and i - j < window when
window > 0 (Mistral/Qwen2 sliding window; window=1 is "only itself"), and
segment_ids[b, i] == segment_ids[b, j] when segment ids are given (packed documents).

`blockwise_attention` never builds a T x T array: the forward is an online softmax over key blocks
and the backward (a custom VJP) recomputes probabilities block by block from the saved fp32
logsumexp, as FlashAttention-2 does. Block pairs the causal mask and the window rule out entirely
are never visited, so its work is ~T^2/2 without a window and ~T*window with one. Every loop it
runs has a trip count known when it is traced (the schedule below): XLA:GPU runs a loop whose
count it only learns at run time from the host, reading its predicate back at every step.
"""

import dataclasses
import functools
import inspect

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax

IMPLEMENTATIONS = ("auto", "cudnn", "blockwise", "xla")

# Finite, so that a row with no visible key in one block gives exp(NEG - NEG) = 1 rather than
# exp(-inf + inf) = NaN; the explicit `where` on the probabilities then zeroes it.
_NEG = -1e30


# -----------------------------------------------------------------------------
# the schedule: which block pairs a group of query blocks visits, in a static number of steps
#
# A group of query blocks (a whole sequence's, or the query tiles of megatrain_jax/seqtile.py that
# attend together) is visited as one flat loop over its (query block, key block) pairs, one query
# block after the other. Causally query block r visits key blocks 0 .. r; with a window of W
# tokens every query block visits the same c = ceil((W - 1) / S) + 1 key blocks r - c + 1 .. r,
# those before block 0 masked out whole (only the first c - 1 query blocks of a sequence have
# any). The number of steps is therefore a Python int wherever the group's size is: with a window
# always, causally for a whole sequence, and for two query tiles t and n - 1 - t of a sequence of
# n tiles, which together visit as many pairs whatever t is.


@dataclasses.dataclass(frozen=True)
class _Span:
    """The static mask and block options of a call: query rows at or after seq_len (padding) see
    nothing; key_blocks is the number of blocks of the keys."""
    seq_len: int
    window: int
    block_size: int
    scale: float
    key_blocks: int

    @property
    def per_row(self) -> int:
        """Key blocks every query block visits (a window narrower than the keys), or 0: causal
        (query block r visits r + 1)."""
        if not self.window:
            return 0
        visited = -(-(self.window - 1) // self.block_size) + 1
        return visited if visited < self.key_blocks else 0

    def count(self, rows) -> int:
        """Steps of a group of query blocks at block indices `rows` (ints)."""
        return len(rows) * self.per_row if self.per_row else sum(r + 1 for r in rows)

    def step(self, k, rows):
        """(slot, key block read, key block seen, first) of step k of the query blocks at block
        indices `rows` ((R,) int): the group's slot of the query block, the key block whose keys
        it reads, the one whose positions the mask sees (before 0: masked out whole, block 0
        read), and whether step k is the query block's first."""
        if self.per_row:
            slot, offset = k // self.per_row, k % self.per_row
            seen = rows[slot] - (self.per_row - 1) + offset
            return slot, jnp.maximum(seen, 0), seen, offset == 0
        starts = jnp.cumsum(rows + 1) - (rows + 1)
        slot = jnp.sum(starts <= k) - 1
        j = k - starts[slot]
        return slot, j, j, j == 0

    def mask(self, row, j, seg_q, seg_k):
        """(B or 1, 1, 1, Q, S) bool: which (query, key) pairs of query block `row` and key block
        `j` (block indices of the whole sequence) may attend."""
        bs = self.block_size
        q_pos = row * bs + jnp.arange(bs)[:, None]  # (Q, 1)
        k_pos = j * bs + jnp.arange(bs)[None, :]  # (1, S)
        # Padded query rows see nothing (their output is discarded, their cotangent is zero);
        # k <= q < T also rules out padded keys.
        mask = (k_pos <= q_pos) & (q_pos < self.seq_len) & (k_pos >= 0)
        if self.window:
            mask &= q_pos - k_pos < self.window
        mask = mask[None]  # (1, Q, S)
        if seg_q is not None:
            mask = mask & (seg_q[:, :, None] == seg_k[:, None, :])  # (B, Q, S)
        return mask[:, None, None]


def block_schedule(rows, *, block_size: int, window: int, key_blocks: int) -> list:
    """The schedule's steps for query blocks at block indices `rows` (ints), in order: (query
    block, key block seen), the key block negative where the step is masked out whole. What tests
    hold against the mask."""
    span = _Span(0, window, block_size, 1.0, key_blocks)
    rows = np.asarray(rows, np.int32)
    steps = (span.step(k, rows) for k in range(span.count(rows.tolist())))
    return [(int(rows[int(slot)]), int(seen)) for slot, _, seen, _ in steps]


# -----------------------------------------------------------------------------
# blockwise (flash) attention over a group of query blocks
#
# The kernels take R query blocks (q (B, R * S, N, H), block b of them at block index rows[b] of
# the sequence) against the keys and values of positions 0 .. Tk - 1 (a multiple of the block),
# so that a block tiled over the sequence (megatrain_jax/seqtile.py) attends its query tiles to
# the whole K and V.


def _blocks(x, block_size: int):
    """(B, T, ...) -> (B, T // block_size, block_size, ...)."""
    return x.reshape(x.shape[0], x.shape[1] // block_size, block_size, *x.shape[2:])


def _block(x, i):
    """Block i of a (B, num_blocks, ...) array, as (B, ...)."""
    return lax.dynamic_index_in_dim(x, i, axis=1, keepdims=False)


def _put(x, value, i):
    """x with block i (axis 1) set to value."""
    return lax.dynamic_update_index_in_dim(x, value.astype(x.dtype), i, axis=1)


def _einsum32(spec: str, a, b):
    """einsum with fp32 accumulation and result, whatever the operands' dtype."""
    return jnp.einsum(spec, a, b, preferred_element_type=jnp.float32)


def _rows_of(x, rows_shape):
    """(B, N, R * Q) -> (B, R, K, G, Q), rows_shape = (R, Q, K, G)."""
    R, Q, K, G = rows_shape
    return x.reshape(x.shape[0], K, G, R, Q).transpose(0, 3, 1, 2, 4)


def _rows_forward(q, k, v, seg_q, seg_k, rows, span: _Span, count: int):
    """(o (B, R * Q, N, H) in q.dtype, lse (B, N, R * Q) fp32) of the query blocks at block
    indices `rows` ((R,) int), in `count` steps (span.count of them)."""
    B, TR, N, H = q.shape
    K = k.shape[2]
    G, bs = N // K, span.block_size
    R = TR // bs
    qb = q.reshape(B, R, bs, K, G, H)
    kb, vb = _blocks(k, bs), _blocks(v, bs)  # (B, nk, S, K, H)
    seg_qb = None if seg_q is None else _blocks(seg_q, bs)  # (B, R, Q)
    seg_kb = None if seg_k is None else _blocks(seg_k, bs)

    def visit(k_step, carry):
        m, l, acc, o, lse = carry  # (B, K, G, Q) x2, (B, K, G, Q, H), fp32; the group's outputs
        slot, j, seen, first = span.step(k_step, rows)
        m, l, acc = (jnp.where(first, x0, x) for x, x0 in zip((m, l, acc), (_NEG, 0.0, 0.0)))
        s = _einsum32("bqkgh,bskh->bkgqs", _block(qb, slot), _block(kb, j)) * span.scale
        mask = span.mask(rows[slot], seen, None if seg_qb is None else _block(seg_qb, slot),
                         None if seg_kb is None else _block(seg_kb, j))
        s = jnp.where(mask, s, _NEG)
        m_new = jnp.maximum(m, s.max(-1))
        p = jnp.where(mask, jnp.exp(s - m_new[..., None]), 0.0)  # (B, K, G, Q, S)
        alpha = jnp.exp(m - m_new)
        l = alpha * l + p.sum(-1)
        acc = alpha[..., None] * acc + _einsum32("bkgqs,bskh->bkgqh", p.astype(v.dtype),
                                                 _block(vb, j))
        # written at every step, the query block's last one final; only padded query rows see
        # no key at all
        seen_any = jnp.where(l > 0, l, 1.0)
        return (m_new, l, acc, _put(o, acc / seen_any[..., None], slot),
                _put(lse, m_new + jnp.log(seen_any), slot))

    init = (jnp.full((B, K, G, bs), _NEG, jnp.float32), jnp.zeros((B, K, G, bs), jnp.float32),
            jnp.zeros((B, K, G, bs, H), jnp.float32), jnp.zeros((B, R, K, G, bs, H), q.dtype),
            jnp.zeros((B, R, K, G, bs), jnp.float32))
    *_, o, lse = lax.fori_loop(0, count, visit, init)
    return (o.transpose(0, 1, 4, 2, 3, 5).reshape(B, TR, N, H),
            lse.transpose(0, 2, 3, 1, 4).reshape(B, N, TR))


def _rows_backward(q, k, v, seg_q, seg_k, rows, o, lse, do, dk, dv, span: _Span, count: int):
    """(dq in q.dtype, dk + these queries' share, dv + theirs): FlashAttention-2's backward, in the
    forward's order (query block after query block, each one's dq carried and written, the key
    blocks' dk and dv added to in place); dk and dv are fp32 (B, Tk, K, H)."""
    B, TR, N, H = q.shape
    K = k.shape[2]
    G, bs = N // K, span.block_size
    R = TR // bs
    # D_i = rowsum(do_i * o_i) = sum_j p_ij dp_ij: the softmax backward's per-row term.
    delta = _einsum32("btnh,btnh->bnt", do.astype(jnp.float32), o.astype(jnp.float32))
    lseb, deltab = (_rows_of(x, (R, bs, K, G)) for x in (lse, delta))  # (B, R, K, G, Q)
    qb, dob = (x.reshape(B, R, bs, K, G, H) for x in (q, do))
    kb, vb = _blocks(k, bs), _blocks(v, bs)  # (B, nk, S, K, H)
    seg_qb = None if seg_q is None else _blocks(seg_q, bs)
    seg_kb = None if seg_k is None else _blocks(seg_k, bs)

    def visit(k_step, carry):
        dq_i, dq, dk, dv = carry  # (B, Q, K, G, H) fp32; (B, R, Q, K, G, H); (B, nk, S, K, H) fp32
        slot, j, seen, first = span.step(k_step, rows)
        q_i, do_i, k_j, v_j = _block(qb, slot), _block(dob, slot), _block(kb, j), _block(vb, j)
        s = _einsum32("bqkgh,bskh->bkgqs", q_i, k_j) * span.scale
        mask = span.mask(rows[slot], seen, None if seg_qb is None else _block(seg_qb, slot),
                         None if seg_kb is None else _block(seg_kb, j))
        p = jnp.where(mask, jnp.exp(s - _block(lseb, slot)[..., None]), 0.0)  # (B, K, G, Q, S)
        dp = _einsum32("bqkgh,bskh->bkgqs", do_i, v_j)
        ds = p * (dp - _block(deltab, slot)[..., None]) * span.scale
        dq_i = jnp.where(first, 0.0, dq_i) + _einsum32("bkgqs,bskh->bqkgh", ds.astype(k.dtype), k_j)
        add = lambda acc, x: _put(acc, _block(acc, j) + x, j)
        dk = add(dk, _einsum32("bkgqs,bqkgh->bskh", ds.astype(q.dtype), q_i))
        dv = add(dv, _einsum32("bkgqs,bqkgh->bskh", p.astype(do.dtype), do_i))
        return dq_i, _put(dq, dq_i, slot), dk, dv  # dq written at every step, the last final

    init = (jnp.zeros((B, bs, K, G, H), jnp.float32), jnp.zeros((B, R, bs, K, G, H), q.dtype),
            _blocks(dk, bs), _blocks(dv, bs))
    _, dq, dk, dv = lax.fori_loop(0, count, visit, init)
    return dq.reshape(B, TR, N, H), dk.reshape(B, -1, K, H), dv.reshape(B, -1, K, H)


def _pad_to(x, length: int):
    """(B, T, ...) zero-padded to (B, length, ...) (None: None)."""
    if x is None or x.shape[1] == length:
        return x
    return jnp.pad(x, [(0, 0), (0, length - x.shape[1])] + [(0, 0)] * (x.ndim - 2))


def _whole(T: int, span: _Span):
    """(rows, count, padded length) of a whole sequence of T tokens as one group."""
    rows = tuple(range(span.key_blocks))
    return (jnp.arange(span.key_blocks, dtype=jnp.int32), span.count(rows),
            len(rows) * span.block_size)


@functools.partial(jax.custom_vjp, nondiff_argnums=(4,))
def _flash(q, k, v, segment_ids, span):
    return _flash_fwd(q, k, v, segment_ids, span)[0]


def _flash_fwd(q, k, v, segment_ids, span):
    T = q.shape[1]
    rows, count, padded = _whole(T, span)
    q, k, v, seg = (_pad_to(x, padded) for x in (q, k, v, segment_ids))
    o, lse = _rows_forward(q, k, v, seg, seg, rows, span, count)
    return o[:, :T], (q, k, v, seg, o, lse)


def _flash_bwd(span, residuals, do):
    q, k, v, seg, o, lse = residuals
    T = do.shape[1]
    rows, count, padded = _whole(T, span)
    with jax.named_scope("blockwise_attention_bwd"):  # traced apart from the forward's scope
        zeros = jnp.zeros(k.shape, jnp.float32)
        dq, dk, dv = _rows_backward(q, k, v, seg, seg, rows, o, lse, _pad_to(do, padded), zeros,
                                    zeros, span, count)
    cut = lambda x, like: x[:, :T].astype(like.dtype)
    return cut(dq, q), cut(dk, k), cut(dv, v), None  # ids get no cotangent


_flash.defvjp(_flash_fwd, _flash_bwd)


# -----------------------------------------------------------------------------
# query tiles against the whole sequence's keys (the block tiled over the sequence)
#
# megatrain_jax/seqtile.py attends query tiles of `tile` tokens (tile t at positions t * tile ..)
# a group at a time: `tiles` their indices (ints, or traced where the group is a loop's step) and
# `like` the indices of a group with as many block pairs in all (ints: the static trip count).
# Both attentions below take the same arguments and give the same results: per tile the output
# (B, tile, N, H) in q's dtype, and a residual (arrays) that `backward` takes back.


@dataclasses.dataclass(frozen=True)
class TileAttention:
    """Blockwise attention of query tiles to the keys and values of positions 0 .. Tk - 1 (B,
    Tk, K, H), Tk a multiple of the block, the tile too. Rows at or after seq_len (padding) see
    nothing. `window` and `block_size` are static."""
    seq_len: int
    window: int
    block_size: int
    scale: float | None = None

    def _span(self, q, keys: int) -> _Span:
        return _Span(self.seq_len, self.window, self.block_size,
                     q.shape[3]**-0.5 if self.scale is None else self.scale,
                     keys // self.block_size)

    def _group(self, qs, keys: int, tiles, like):
        """(span, rows of the group's query blocks, steps)."""
        per_tile = qs[0].shape[1] // self.block_size
        span = self._span(qs[0], keys)
        rows = jnp.concatenate([t * per_tile + jnp.arange(per_tile, dtype=jnp.int32)
                                for t in tiles])
        return span, rows, span.count([t * per_tile + i for t in like for i in range(per_tile)])

    def forward(self, qs, k, v, seg_qs, seg_k, tiles, *, like):
        """(outs, lses): per tile of qs (each (B, tile, N, H)) its output and its log-sum-exps
        (B, N, tile) fp32; seg_qs (each (B, tile)) and seg_k (B, Tk) the document ids (None:
        none)."""
        with jax.named_scope("tile_attention"):
            span, rows, count = self._group(qs, k.shape[1], tiles, like)
            o, lse = _rows_forward(jnp.concatenate(qs, 1), k, v, _joined(seg_qs), seg_k, rows,
                                   span, count)
            return _split(o, len(qs), 1), _split(lse, len(qs), 2)

    def backward(self, qs, k, v, seg_qs, seg_k, tiles, outs, lses, dos, dk, dv, *, like):
        """(dqs, dk, dv): dk and dv (key_accumulator's) plus these tiles' share."""
        with jax.named_scope("tile_attention_bwd"):
            span, rows, count = self._group(qs, k.shape[1], tiles, like)
            cat = lambda xs, axis=1: jnp.concatenate(xs, axis)
            dq, dk, dv = _rows_backward(cat(qs), k, v, _joined(seg_qs), seg_k, rows, cat(outs),
                                        cat(lses, 2), cat(dos), dk, dv, span, count)
            return _split(dq, len(qs), 1), dk, dv


def _joined(segs):
    return None if segs is None else jnp.concatenate(segs, 1)


def _split(x, parts: int, axis: int) -> tuple:
    return tuple(jnp.split(x, parts, axis=axis))


def key_accumulator(k):
    """Zeros for a tile attention's dk (or dv): fp32, k's shape."""
    return jnp.zeros(k.shape, jnp.float32)


def keys_of(acc, like, start, size: int):
    """Rows start .. start + size - 1 of an accumulator, as `like`'s dtype (B, size, K, H)."""
    return lax.dynamic_slice_in_dim(acc, start, size, axis=1).astype(like.dtype)


def merge_supported() -> str:
    """Why this jax cannot merge attention calls (MergedTileAttention), or "": it needs
    `jax.nn.dot_product_attention`'s return_residual (the log-sum-exps) and
    key_value_seq_lengths."""
    params = inspect.signature(jax.nn.dot_product_attention).parameters
    missing = [p for p in ("return_residual", "key_value_seq_lengths") if p not in params]
    return (f"jax {jax.__version__}'s dot_product_attention has no {', '.join(missing)}"
            if missing else "")


def query_offsets_supported() -> str:
    """Why this jax has no causal query offset for a tile of queries (candidate (c) of
    docs/long-context.md: `query_seq_offsets`, jax-ml/jax#29731), or "" where it has one."""
    if "query_seq_offsets" in inspect.signature(jax.nn.dot_product_attention).parameters:
        return ""
    return f"jax {jax.__version__}'s dot_product_attention has no query_seq_offsets"


@dataclasses.dataclass(frozen=True)
class MergedTileAttention:
    """Per query tile at `start`, two calls of `jax.nn.dot_product_attention` (`implementation`:
    "cudnn", or "xla" standing in where cuDNN cannot run): the keys before the tile, unmasked (all
    Tk of them passed, key_value_seq_lengths = start), and the tile's own keys, causal; the two
    merged by their log-sum-exps. No window, no document mask.

    Its backward is exact without differentiating a log-sum-exp (neither implementation gives one
    a gradient: jax stops it, or cuDNN's rule drops its cotangent). With P_j a call's
    probabilities, w_j = exp(lse_j - lse) its weight in the merge, o_j its output and
    D = rowsum(do * o) of the merged one, the true dS of call j is w_j P_j (dP - D), while the
    VJP of the call's output with cotangent w_j do gives w_j P_j (dP - D_j), D_j = rowsum(do *
    o_j). The difference, g_j P_j with g_j = w_j (D_j - D) per row, adds scale * g_j * (P_j K) to
    dq (the call itself with the keys as values) and scale * P_j^T (g_j q) to dk (the same VJP's
    dv for the cotangent g_j q).

    jax returns the log-sum-exps in the inputs' dtype: in bf16 the merge's weights carry bf16
    rounding (up to ~3% each for a log-sum-exp near 16), beyond the outputs' own, and
    key_value_seq_lengths is assumed to bound cuDNN's work to the keys before the tile: both are
    the GPU checklist's to measure (docs/long-context.md)."""
    seq_len: int
    implementation: str
    scale: float | None = None

    def _scale(self, q):
        return q.shape[3]**-0.5 if self.scale is None else self.scale

    def _calls(self, q, k, v, start):
        """The two calls of a tile at `start`: [(f(q, keys, values) -> o, keys, values)]; `keys`
        `values` the ones the call reads (all of them before, the tile's own)."""
        tile, lengths = q.shape[1], jnp.full((q.shape[0],), jnp.maximum(start, 1), jnp.int32)
        call = functools.partial(jax.nn.dot_product_attention, scale=self._scale(q),
                                 implementation=self.implementation)
        own = lambda x: lax.dynamic_slice_in_dim(x, start, tile, axis=1)
        # a tile at 0 has no keys before it: one key is read (cuDNN's lengths start at 1) and the
        # call's weight in the merge made 0
        return [(functools.partial(call, key_value_seq_lengths=lengths), k, v),
                (functools.partial(call, is_causal=True), own(k), own(v))]

    def _tile(self, q, k, v, start):
        """(o in q.dtype, lse (B, N, tile) fp32, the calls' lse (2, B, tile, N) fp32)."""
        parts = [f(q, keys, values, return_residual=True)
                 for f, keys, values in self._calls(q, k, v, start)]
        lses = jnp.stack([lse.astype(jnp.float32) for _, lse in parts])  # (2, B, tile, N)
        lses = lses.at[0].set(jnp.where(start > 0, lses[0], -jnp.inf))
        lse = jax.nn.logsumexp(lses, axis=0)
        weights = jnp.exp(lses - lse)[..., None]  # (2, B, tile, N, 1)
        o = weights[0] * parts[0][0].astype(jnp.float32) + weights[1] * parts[1][0]
        return o.astype(q.dtype), lse.transpose(0, 2, 1), lses

    def forward(self, qs, k, v, seg_qs, seg_k, tiles, *, like):
        if seg_qs is not None:
            raise ValueError("merged tile attention takes no document mask")
        with jax.named_scope("tile_attention_merged"):
            tiled = [self._tile(q, k, v, t * q.shape[1]) for q, t in zip(qs, tiles)]
            return tuple(o for o, _, _ in tiled), tuple((lse, parts) for _, lse, parts in tiled)

    def backward(self, qs, k, v, seg_qs, seg_k, tiles, outs, lses, dos, dk, dv, *, like):
        with jax.named_scope("tile_attention_merged_bwd"):
            dqs = []
            for q, t, o, (lse, parts), do in zip(qs, tiles, outs, lses, dos):
                dq, dk, dv = self._tile_backward(q, k, v, t * q.shape[1], o, lse, parts, do, dk,
                                                 dv)
                dqs.append(dq)
            return tuple(dqs), dk, dv

    def _tile_backward(self, q, k, v, start, o, lse, parts, do, dk, dv):
        tile, scale = q.shape[1], self._scale(q)
        do32 = do.astype(jnp.float32)
        D = jnp.sum(do32 * o.astype(jnp.float32), -1)  # (B, tile, N)
        dq = jnp.zeros(q.shape, jnp.float32)
        for j, (f, keys, values) in enumerate(self._calls(q, k, v, start)):
            w = jnp.exp(parts[j] - lse.transpose(0, 2, 1))  # (B, tile, N); 0 before tile 0
            o_j, vjp = jax.vjp(f, q, keys, values)
            g = w * (jnp.sum(do32 * o_j.astype(jnp.float32), -1) - D)
            dq_j, dk_j, dv_j = vjp((w[..., None] * do32).astype(o_j.dtype))
            dk_extra = vjp((scale * g[..., None] * q.astype(jnp.float32)).astype(o_j.dtype))[2]
            p_keys = f(q, keys, keys).astype(jnp.float32)  # P_j K
            dq = dq + dq_j.astype(jnp.float32) + scale * g[..., None] * p_keys
            grads = (dk_j.astype(jnp.float32) + dk_extra, dv_j.astype(jnp.float32))
            if j == 0:  # every key, those from start on with a zero gradient
                dk, dv = dk + grads[0], dv + grads[1]
            else:
                add = lambda acc, x: lax.dynamic_update_slice_in_dim(
                    acc, lax.dynamic_slice_in_dim(acc, start, tile, 1) + x, start, 1)
                dk, dv = add(dk, grads[0]), add(dv, grads[1])
        return dq.astype(q.dtype), dk, dv


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
        bs = min(block_size, T)
        return _flash(q, k, v, segment_ids,
                      _Span(T, window, bs, q.shape[3]**-0.5 if scale is None else scale,
                            -(-T // bs)))


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
# choosing: the one rule, and dispatching

# What runs where the block is tiled over the sequence: blockwise attention per query tile,
# cuDNN's calls merged per query tile (MergedTileAttention), or the sequence's attention untiled
# with the rest of the block tiled around it (megatrain_jax/model.py's Block).
TILED = ("blockwise", "merged", "untiled")
BLOCKS = (512, 1024, 2048)  # blockwise's blocks the GPU checklist measures
DEFAULT_BLOCK = 512  # the block before any was measured
# Seconds of one layer's backward (recompute and VJP) of Llama-3-8B's shapes at 32,768 tokens in
# tiles of 8,192, by platform and candidate ("blockwise/<block>", "merged", "untiled"), from
# scripts/bench_tile_attention.py's JSON (part 7 of scripts/gpu_checklist.py); a platform with
# nothing measured keeps the choice made before (blockwise per query tile in blocks of 512) and
# says so. gpu: an H200, jax 0.11.2, 2026-11-28 (docs/results/2026-11-28-h200/tile_attention.json).
MEASURED: dict = {
    "gpu": {"blockwise/512": 0.629, "blockwise/1024": 0.388, "blockwise/2048": 0.334,
            "merged": 0.191, "untiled": 0.120},
}


@dataclasses.dataclass(frozen=True)
class Choice:
    """What runs: `attention` over a whole sequence ("cudnn", "blockwise" or "xla"); `tiled`
    (TILED) where the block is tiled over the sequence; blockwise's `block`; why; and `notice`,
    one line where train.attention asked for what cannot run here ("" otherwise)."""
    attention: str
    tiled: str
    block: int
    reason: str
    notice: str = ""


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


def choose_attention(requested: str, *, platform: str, dtype, head_dim: int, document_mask: bool,
                     windowed: bool = False, block: int = 0, tile: int = 0,
                     measured: dict | None = None, exclude: tuple = ()) -> Choice:
    """The attention that runs for train.attention `requested` (IMPLEMENTATIONS) on `platform`,
    untiled and tiled, and blockwise's block (`block`, 0: chosen). `windowed`: a layer has a
    sliding window; `tile`: train.tile_size; `measured`: MEASURED's figures of the platform;
    `exclude`: tiled candidates not to take ("untiled", "merged": the plan's, where the faster
    does not fit the device).

    Untiled: "auto" is cuDNN where it can run, else blockwise; "blockwise" and "xla" as asked;
    "cudnn" where it cannot run gives blockwise and a notice. Tiled: XLA's attention is never
    tiled (the MLP is); otherwise the fastest measured candidate that can run (cuDNN's only
    where it runs, and only where train.attention=cudnn asks for it) and, with nothing measured,
    blockwise per query tile (cuDNN untiled where train.attention=cudnn asks for cuDNN). The
    block: the one asked for, else the fastest measured that divides the tile, else 512.
    ValueError for an unknown `requested`."""
    if requested not in IMPLEMENTATIONS:
        raise ValueError(f"train.attention must be one of {IMPLEMENTATIONS}, got {requested!r}")
    why_not = _cudnn_unsupported(platform=platform, dtype=dtype, head_dim=head_dim,
                                 document_mask=document_mask)
    notice = ""
    if requested in ("blockwise", "xla"):
        attention, why = requested, f"requested {requested}"
    elif why_not:
        attention, why = "blockwise", why_not
        if requested == "cudnn":
            notice = (f"train.attention=cudnn cannot run here ({why_not}): blockwise attention "
                      f"runs instead")
    else:
        attention = "cudnn"
        why = ("requested cudnn" if requested == "cudnn" else
               f"GPU, {jnp.dtype(dtype).name}, head dim {head_dim}, no document mask")
    measured = MEASURED.get(platform, {}) if measured is None else measured
    blocks = [block] if block else [b for b in BLOCKS if not tile or tile % b == 0]
    timed_blocks = {b: measured[f"blockwise/{b}"] for b in blocks if f"blockwise/{b}" in measured}
    block = block or (min(timed_blocks, key=timed_blocks.get) if timed_blocks else DEFAULT_BLOCK)
    if attention == "xla":
        return Choice("xla", "untiled", block, f"{why}; tiled: XLA's attention is never tiled, "
                      f"the MLP is", notice)
    candidates = [f"blockwise/{block}"]
    if attention == "cudnn":
        candidates = ["untiled"] if requested == "cudnn" else candidates + ["untiled"]
        if not windowed and not merge_supported():
            candidates.append("merged")
    candidates = [c for c in candidates if c not in exclude] or [f"blockwise/{block}"]
    timed = {c: measured[c] for c in candidates if c in measured}
    if timed:
        best = min(timed, key=timed.get)
        tiled_why = (f"the fastest measured on {platform}: " + ", ".join(
            f"{c} {s:.3g} s" for c, s in sorted(timed.items(), key=lambda cs: cs[1])))
    elif attention == "cudnn" and requested == "cudnn":
        best, tiled_why = "untiled", f"nothing measured on {platform}: cuDNN untiled, as asked"
    else:
        best = f"blockwise/{block}"
        tiled_why = (f"nothing measured on {platform}: blockwise per query tile, as before "
                     f"cuDNN's tiled candidates were measured" if attention == "cudnn" else
                     "blockwise per query tile")
    return Choice(attention, best.split("/")[0], block, f"{why}; tiled: {tiled_why}", notice)


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
                     f"choose_attention), got {implementation!r}")
