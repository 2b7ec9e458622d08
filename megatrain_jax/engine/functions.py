"""The jitted device functions of one step, built from the graphdefs of the streamed modules.

The engine calls user modules in three shapes: `first(inputs) -> x`, `block(x)` or
`block(x, context)` (when the step has a context, e.g. document masks), returning x or
`(x, aux)` (see below), and `last(x, targets)`,
which returns either a scalar mean loss or a pair `(loss_sum, weight)` (a sum over counted tokens
and how many were counted), or a triple `(loss_sum, weight, stats)`, stats a pytree of fp32 sums
to report (not differentiated), which the step adds up over its micro-batches. A step's loss is `sum(loss_sum) / sum(weight)` over its micro-batches
(a scalar mean counts as weight 1), so micro-batches with different numbers of counted tokens
still give the gradient of one big batch. The device functions differentiate the unnormalised
sums; the host scales every gradient by `1 / sum(weight)` before the update.

Auxiliary losses (a mixture of experts' load balancing): a block may return `(x, aux)`, aux a
pytree of fp32 statistics that add up over tokens (sums, counts). The step sums them over layers
and micro-batches and adds `aux_loss(total)` to its loss; the cotangent of every layer's aux is
then `grad(aux_loss)(total)`, known once the forward is done, times `sum(weight)` (the host's
`1 / sum(weight)` scaling undoes it). A total over all tokens is what one forward over the big
batch computes, so micro-batches still equal one big batch.
"""

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from megatrain_jax.engine.parallel import Placement, sum_squares, zeros_like_acc
from megatrain_jax.engine.transfer import with_copies


def tree_add(acc, tree):
    return jax.tree.map(lambda a, g: a + g.astype(jnp.float32), acc, tree)


def split_loss(out):
    """`last`'s output as (loss_sum, weight, stats), fp32; stats None when `last` returns none."""
    stats = None
    if isinstance(out, (tuple, list)):
        loss_sum, weight, *rest = out
        stats = rest[0] if rest else None
    else:
        loss_sum, weight = out, 1.0
    if stats is not None:
        stats = jax.tree.map(lambda s: jnp.asarray(s, jnp.float32), stats)
    return jnp.asarray(loss_sum, jnp.float32), jnp.asarray(weight, jnp.float32), stats


@dataclasses.dataclass(frozen=True)
class StageParts:
    """Which leaves of the stages unit `first` and `last` read (tied weights: both).

    The stages unit is fetched three times a step, each time only the part that is used: the
    embedding alone for the forward and the backward's end, the head alone for the loss."""
    first: tuple  # indices into jax.tree.leaves(stages params)
    last: tuple

    def take(self, which: str, leaves: list) -> list:
        return [leaves[i] for i in getattr(self, which)]


def used_inputs(fn, leaves) -> tuple:
    """Indices of `leaves` that fn(leaves) reads, from its jaxpr."""
    jaxpr = jax.make_jaxpr(fn)(leaves).jaxpr
    used = {id(v) for eqn in jaxpr.eqns for v in eqn.invars}
    used |= {id(v) for v in jaxpr.outvars}
    return tuple(i for i, v in enumerate(jaxpr.invars) if id(v) in used)


def stage_parts(stages_def, stages_params, inputs, targets=None, head=None) -> StageParts:
    """Traces first and last abstractly on example shapes to see which leaves each reads.
    `inputs` and `targets` are arrays or jax.ShapeDtypeStruct (then zeros of that shape stand in:
    token ids, small next to the weights; numpy's, so that int64 ids become jax's int32 as the
    arrays themselves would, without a warning). head(last, x): what runs of the last stage
    (default: its loss on `targets`; generation: its logits, engine/decode.py)."""
    example = lambda x: np.zeros(x.shape, x.dtype) if isinstance(x, jax.ShapeDtypeStruct) else x
    inputs, targets = example(inputs), jax.tree.map(example, targets)
    head = head or (lambda last, x: split_loss(last(x, targets)))
    leaves, treedef = jax.tree.flatten(stages_params)
    abstract = [jax.ShapeDtypeStruct(x.shape, x.dtype) for x in leaves]

    def first(leaves):
        return nnx.merge(stages_def, jax.tree.unflatten(treedef, leaves))[0](inputs)

    x = jax.eval_shape(first, abstract)

    def last(leaves):
        return head(nnx.merge(stages_def, jax.tree.unflatten(treedef, leaves))[1],
                    jnp.zeros(x.shape, x.dtype))

    return StageParts(used_inputs(first, abstract), used_inputs(last, abstract))


def merge_part(stages_def, stages_treedef, indices: tuple, leaves: list) -> tuple:
    """The (first, last) stage modules from one part's leaves, `leaves[k]` the stages' leaf
    `indices[k]` (StageParts); the other leaves stand in unread."""
    full = [jax.ShapeDtypeStruct((), jnp.float32)] * stages_treedef.num_leaves
    for i, leaf in zip(indices, leaves):
        full[i] = leaf
    return nnx.merge(stages_def, jax.tree.unflatten(stages_treedef, full))


@jax.jit
def norm_and_scale(layers_sq, stages_sq, weight):
    """(global norm of the scaled gradient, scale = 1 / sum of loss weights), where the sums of
    squares are (a list of the layers', the stages')."""
    scale = jnp.where(weight > 0, 1.0 / jnp.where(weight > 0, weight, 1.0), 0.0)
    return jnp.sqrt(sum(layers_sq) + stages_sq) * scale, scale


class DeviceFunctions:
    """Every function the step runs on the compute device, jitted once per shape.

    Stage weights come as flat leaf lists of one part (StageParts): `embed` and `embed_bwd` take
    the `first` part, `head` and `head_loss` (the loss without gradients, for evaluation) the
    `last` part; `block_fwd` and `block_bwd` a layer as (its weights, its Constants).
    Accumulators are fp32 and donated; with several devices they hold one partial sum per device
    until `reduce` (parallel.py)."""

    def __init__(self, stages_def, stages_treedef, parts: StageParts, block_def, grad_dtype,
                 aux_loss=None, placement: Placement | None = None):
        # Several devices: each function runs on every device over its rows (parallel.py); sums
        # over tokens (loss, weight, aux) are then summed over the devices, gradients accumulate
        # per device until `reduce`.
        on = placement or Placement([jax.local_devices()[0]])
        everywhere = on.sum_over_devices

        def merge_stages(part: str, leaves):
            return merge_part(stages_def, stages_treedef, getattr(parts, part), leaves)

        def embed(w, inputs):
            return merge_stages("first", w)[0](inputs)

        def head(w, x, targets, acc):
            def loss_fn(w, x):
                loss_sum, weight, stats = split_loss(merge_stages("last", w)[1](x, targets))
                return loss_sum, (weight, stats)
            (loss_sum, (weight, stats)), (dw, dx) = jax.value_and_grad(
                loss_fn, argnums=(0, 1), has_aux=True)(w, x)
            return (everywhere(loss_sum), everywhere(weight), everywhere(stats), dx,
                    tree_add(acc, dw))

        def head_loss(w, x, targets):
            """The loss alone, for evaluation: (loss_sum, weight, stats), no gradient."""
            return everywhere(split_loss(merge_stages("last", w)[1](x, targets)))

        self._merge_stages = merge_stages
        self._outputs = {}

        def embed_bwd(w, inputs, dx, acc):
            # Differentiated at fp32 weights with an fp32 cotangent, so that the embedding's
            # scatter-add of a frequent token's many rows accumulates in fp32, not in bf16.
            w32 = [p.astype(jnp.float32) for p in w]
            _, vjp = jax.vjp(lambda w: embed(w, inputs), w32)
            return tree_add(acc, vjp(dx.astype(jnp.float32))[0])

        def block_fwd(layer, x, context):
            """(y, aux): aux None for a block that returns y alone. layer: (its weights, its
            Constants, stage_units.py; {} where it has none)."""
            w, constants = layer
            block = nnx.merge(block_def, w, constants)
            out = block(x) if context is None else block(x, context)
            return tuple(out) if isinstance(out, (tuple, list)) else (out, None)

        def block_fwd_total(layer, x, context):
            y, aux = block_fwd(layer, x, context)
            return y, everywhere(aux)

        def block_bwd(layer, x, context, dy, acc, daux=None):
            # Recompute the block from its saved input, then differentiate it (its weights, not
            # its Constants). Each device's aux is its rows' part of the total, so its cotangent
            # is the total's: daux as given.
            w, constants = layer
            (_, aux), vjp = jax.vjp(lambda w, x: block_fwd((w, constants), x, context), w, x)
            if daux is None:  # e.g. compiled alone for its memory: a zero cotangent
                daux = jax.tree.map(jnp.zeros_like, aux)
            dw, dx = vjp((dy, daux))
            return dx, tree_add(acc, dw)

        def aux_grad(total, weight):
            """(aux_loss(total), its gradient times the loss weight: every layer's cotangent)."""
            value, grad = jax.value_and_grad(lambda t: jnp.asarray(aux_loss(t), jnp.float32))(
                total)
            return value, jax.tree.map(lambda g: g * weight, grad)

        self.embed = on.spread(embed, ("w", "b"), "b")
        self.head = on.spread(head, ("w", "b", "b", "b"), ("w", "w", "w", "b", "b"),
                              donate_argnums=(3,))
        self.head_loss = on.spread(head_loss, ("w", "b", "b"), ("w", "w", "w"))
        self.embed_bwd = on.spread(embed_bwd, ("w", "b", "b", "b"), "b", donate_argnums=(3,))
        self.block_fwd = on.spread(block_fwd_total, ("w", "b", "b"), ("b", "w"))
        self.block_bwd = on.spread(block_bwd, ("w", "b", "b", "b", "b", "w"), ("b", "b"),
                                   donate_argnums=(3, 4))
        # The jit form's calls (engine/schedule.py): the same functions with copies made inside
        # them (transfer.with_copies: the next layer's fetch in, the previous one's gradient
        # out), as (fetch, out, *args); one device only
        if not on.data_parallel:
            carrying = lambda fn, **kw: jax.jit(with_copies(fn, on.local_devices[0]), **kw)
            self.block_fwd_carry = carrying(block_fwd_total)
            self.block_bwd_carry = carrying(block_bwd, donate_argnums=(5, 6))
            self.embed_bwd_carry = carrying(embed_bwd, donate_argnums=(5,))
        self.zeros = zeros_like_acc(on)
        # The devices' partial gradients summed (or reduce-scattered), on the devices; a layer's
        # with its sum of squares: (grads, sq).
        self.reduce = on.reducer()
        self.reduce_squares = on.reducer(squares=True)
        self.aux_loss = aux_loss
        self.aux_grad = jax.jit(aux_grad) if aux_loss is not None else None
        self.tree_total = jax.jit(lambda trees: jax.tree.map(lambda *xs: sum(xs), *trees))
        self.cast_grads = jax.jit(lambda g: jax.tree.map(lambda x: x.astype(grad_dtype), g))
        self.sum_squares = jax.jit(sum_squares)
        # each leaf's, in the order sum_squares adds them (the host lookup adds them up there)
        self.leaf_squares = jax.jit(lambda xs: [sum_squares(x) for x in xs])
        # The first stage on the host CPU device (engine/lookup.py), where its inputs are.
        self.host_embed = jax.jit(embed)
        self.host_embed_bwd = jax.jit(embed_bwd, donate_argnums=(3,))
        # One dispatch each for what would otherwise be L (or M) eager adds per step.
        self.total = jax.jit(lambda xs: sum(xs))

    def head_output(self, output):
        """jit of `output(last, x, targets)` with the last stage merged from its part's leaves
        (`output` may read what `last` reads), compiled once per `output` and shape."""
        if output not in self._outputs:
            merge = self._merge_stages
            self._outputs[output] = jax.jit(lambda w, x, t: output(merge("last", w)[1], x, t))
        return self._outputs[output]
