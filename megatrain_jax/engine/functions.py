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
import functools
import operator

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from megatrain_jax.engine import stage_units
from megatrain_jax.engine.packing import PerLeaf
from megatrain_jax.engine.parallel import Placement, sum_squares
from megatrain_jax.engine.schedule import EAGER, JIT
from megatrain_jax.engine.transfer import PINNED, with_copies


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


def fold(stacked):
    """Each leaf's sum over its leading (micro-batch) axis, m = 0 first: the order in which a
    Python sum over per-micro-batch results adds them, so the same bits."""
    return jax.tree.map(lambda a: functools.reduce(operator.add, [a[m] for m in range(len(a))]),
                        stacked)


def norm_and_scale(layers_sq, stages_sq, weight):
    """(global norm of the scaled gradient, scale = 1 / sum of loss weights), where the sums of
    squares are (a list of the layers', the stages')."""
    scale = jnp.where(weight > 0, 1.0 / jnp.where(weight > 0, weight, 1.0), 0.0)
    return jnp.sqrt(sum(layers_sq) + stages_sq) * scale, scale


class DeviceFunctions:
    """Every function the step runs on the compute device, jitted once per shape.

    A step's M micro-batches come stacked, (M, rows, ...), and each call runs all of them: the
    micro-batches are a lax.scan inside it (`unroll`: the loop unrolled in the traced program
    instead; docs/benchmarks.md measured both), each one computed as it would be alone, every sum
    over them taken in their order (m = 0 first), so the results are those of one call per
    micro-batch. A layer's call starts its gradient at zero, accumulates it in fp32, sums it over
    the devices (Placement.reduce), takes its sum of squares and casts it to `grad_dtype`, all
    inside.

    The calls that stream (`layer_fwd`, `layer_bwd`, `embed_bwd`) take `(fetch, out, *args)`
    (transfer.with_copies): `fetch` (a unit's bus copy and saved inputs in pinned host memory)
    copied to the device and `out` (a gradient) to its pinned host memory inside the call, beside
    its compute (the jit form, engine/step.py), each None when there is none. `copies` the
    copies' form (schedule.EAGER or JIT): in the jit form `stages` leaves the stages' gradient
    and the scalars the host update reads in pinned host memory too.

    Stage weights come as flat leaf lists of one part (StageParts): `embed` and `embed_bwd` take
    the `first` part, `head` and `head_loss` (the loss without gradients, for evaluation) the
    `last` part. `block_fwd` and `block_bwd` are one micro-batch's block alone on one device
    (what a layer's call computes per micro-batch; a long-context bench reads their workspace,
    tests call them one micro-batch at a time). A layer comes to `block_*` and `layer_*` as
    (its weights, its Constants: stage_units.py; {} where it has none); only the weights are
    differentiated. `layer_fwd` and `layer_bwd` take the weights and make the gradient as the
    block unit's `packing` has them (engine/packing.py; default leaf by leaf): flat, one array
    each, split into the block's tree by static slices inside the call and the gradient made flat
    there; `block_*` take the tree. counters (stream.Counters): each function's calls on the
    dispatching thread counted there."""

    def __init__(self, stages_def, stages_treedef, parts: StageParts, block_def, grad_dtype,
                 aux_loss=None, placement: Placement | None = None, counters=None,
                 copies: str = EAGER, unroll: bool = False, packing=None):
        # Several devices: each function runs on every device over its rows (parallel.py); sums
        # over tokens (loss, weight, aux) are then summed over the devices, gradients accumulate
        # per device until `on.reduce`.
        on = placement or Placement([jax.local_devices()[0]])
        self.packing = packing = packing or PerLeaf(None, ())
        everywhere = on.sum_over_devices
        each = functools.partial(jax.lax.scan, unroll=unroll)
        f32_zeros = lambda w: jax.tree.map(lambda p: jnp.zeros(p.shape, jnp.float32), w)

        def merge_stages(part: str, leaves):
            return merge_part(stages_def, stages_treedef, getattr(parts, part), leaves)

        def embed_one(w, inputs):
            return merge_stages("first", w)[0](inputs)

        def embed(w, inputs):
            return each(lambda _, x: (None, embed_one(w, x)), None, inputs)[1]

        def head_one(w, x, targets, acc):
            def loss_fn(w, x):
                loss_sum, weight, stats = split_loss(merge_stages("last", w)[1](x, targets))
                return loss_sum, (weight, stats)
            (loss_sum, (weight, stats)), (dw, dx) = jax.value_and_grad(
                loss_fn, argnums=(0, 1), has_aux=True)(w, x)
            return (everywhere(loss_sum), everywhere(weight), everywhere(stats), dx,
                    tree_add(acc, dw))

        def totals(loss_sums, weights, stats):
            """(loss, its weight, the statistics) over the micro-batches."""
            loss_sum, weight, stats = fold((loss_sums, weights, stats))
            return loss_sum / jnp.where(weight > 0, weight, 1.0), loss_sum, weight, stats

        def head(w, xs, targets):
            """(loss, total weight, statistics, dx[m] stacked, the last part's gradient in fp32
            summed over the devices)."""
            def body(acc, xt):
                loss_sum, weight, stats, dx, acc = head_one(w, *xt, acc)
                return acc, (loss_sum, weight, stats, dx)
            acc, (loss_sums, weights, stats, dxs) = each(body, f32_zeros(w), (xs, targets))
            loss, _, weight, stats = totals(loss_sums, weights, stats)
            return loss, weight, stats, dxs, on.reduce(acc)[0]

        def head_loss(w, xs, targets):
            """The loss alone, for evaluation: (loss, loss_sum, weight, stats), no gradient."""
            out = each(lambda _, xt: (None, everywhere(split_loss(
                merge_stages("last", w)[1](*xt)))), None, (xs, targets))[1]
            return totals(*out)

        self._merge_stages = merge_stages
        self._outputs = {}
        self._each = each

        def embed_bwd_one(w, inputs, dx, acc):
            # Differentiated at fp32 weights with an fp32 cotangent, so that the embedding's
            # scatter-add of a frequent token's many rows accumulates in fp32, not in bf16.
            w32 = [p.astype(jnp.float32) for p in w]
            _, vjp = jax.vjp(lambda w: embed_one(w, inputs), w32)
            return tree_add(acc, vjp(dx.astype(jnp.float32))[0])

        def embed_bwd_into(w, inputs, dxs, acc):
            """The first part's gradient over the micro-batches, added to `acc` (fp32)."""
            return each(lambda acc, xd: (embed_bwd_one(w, *xd, acc), None), acc,
                        (inputs, dxs))[0]

        def embed_bwd(w, inputs, dxs):
            """The first part's gradient in fp32, summed over the devices."""
            return on.reduce(embed_bwd_into(w, inputs, dxs, f32_zeros(w)))[0]

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

        def unpacked(layer):
            w, constants = layer
            return packing.unpack(w), constants

        def layer_fwd(layer, xs, contexts):
            """(y[m], aux[m]) stacked; aux None for blocks that return y alone."""
            layer = unpacked(layer)
            return each(lambda _, xc: (None, block_fwd_total(layer, *xc)), None,
                        (xs, contexts))[1]

        def layer_bwd(layer, xs, contexts, dys, daux=None):
            """(dx[m] stacked, the layer's gradient summed over the devices in `grad_dtype`
            (packed), its sum of squares taken in fp32)."""
            layer = unpacked(layer)

            def body(acc, xcd):
                dx, acc = block_bwd(layer, *xcd, acc, daux)
                return acc, dx
            acc, dxs = each(body, f32_zeros(layer[0]), (xs, contexts, dys))
            grads, sq = on.reduce(acc)
            return dxs, packing.pack(grads, grad_dtype), sq

        def stages(first, last, layers_sq, weight, held, sharding):
            """The stages' gradient leaves `held` ((index, shape) of each, as
            stage_units.gradient) in `grad_dtype` from the two parts' (first, last), their sum of
            squares, and (global norm, scale) from it and the layers' (`layers_sq`, in the
            backward's order) and the total loss weight: (leaves, (norm, scale), stages_sq)."""
            leaves = stage_units.gradient(first, last, parts.first, parts.last, held, grad_dtype,
                                          sharding)
            stages_sq = sum_squares(leaves)
            return leaves, norm_and_scale(layers_sq, stages_sq, weight), stages_sq

        def last_unit(last, held):
            """The host lookup's: the last unit's gradient leaves `held` in `grad_dtype` from the
            last part's, and each one's sum of squares."""
            leaves = stage_units.gradient([], last, (), parts.last, held, grad_dtype, None)
            return leaves, [sum_squares(x) for x in leaves]

        def aux_grad(auxs, weight, loss):
            """From each layer's aux[m] (stacked): (loss + aux_loss(total), aux_loss(total), its
            gradient times the loss weight: every layer's cotangent)."""
            num_micro = len(jax.tree.leaves(auxs[0])[0])
            each_aux = [jax.tree.map(lambda a: a[m], aux) for aux in auxs for m in range(num_micro)]
            total = jax.tree.map(lambda *xs: functools.reduce(operator.add, xs), *each_aux)
            value, grad = jax.value_and_grad(lambda t: jnp.asarray(aux_loss(t), jnp.float32))(
                total)
            return loss + value, value, jax.tree.map(lambda g: g * weight, grad)

        # The streaming calls, as (fetch, out, *args): the copies inside them on one device
        # (transfer.with_copies); with several, none (the eager form's, always None)
        if on.data_parallel:
            streaming = lambda fn, **kw: (lambda fetch, out, *args: (fn(*args), None, None))
        else:
            streaming = lambda fn, **kw: jax.jit(with_copies(fn, on.local_devices[0]), **kw)
        self.embed = on.spread(embed, ("w", "b"), "b")
        self.head = on.spread(head, ("w", "b", "b"), ("w", "w", "w", "b", "r"))
        self.head_loss = on.spread(head_loss, ("w", "b", "b"), ("w", "w", "w", "w"))
        self.layer_fwd = streaming(on.spread(layer_fwd, ("w", "b", "b"), ("b", "w")))
        self.layer_bwd = streaming(on.spread(layer_bwd, ("w", "b", "b", "b", "w"),
                                             ("b", "r", "w"), donate_argnums=(3,)),
                                   donate_argnums=(5,))
        self.embed_bwd = streaming(on.spread(embed_bwd, ("w", "b", "b"), "r"))
        self.block_fwd = jax.jit(block_fwd)
        self.block_bwd = jax.jit(block_bwd, donate_argnums=(3, 4))
        pinned = (jax.sharding.SingleDeviceSharding(on.local_devices[0], memory_kind=PINNED)
                  if copies == JIT else None)
        self.stages = jax.jit(stages, static_argnums=(4, 5),
                              out_shardings=pinned and (pinned, pinned, None))
        self.last_unit = jax.jit(last_unit, static_argnums=(1,))
        self.aux_loss = aux_loss
        self.aux_grad = jax.jit(aux_grad) if aux_loss is not None else None
        # One dispatch for what would otherwise be L eager adds (the host lookup's layers' sums of
        # squares)
        self.total = jax.jit(lambda xs: sum(xs))
        # each leaf's, in the order sum_squares adds them (the host lookup adds them up there)
        self.leaf_squares = jax.jit(lambda xs: [sum_squares(x) for x in xs])
        # The first stage on the host CPU device (engine/lookup.py), where its inputs are.
        self.host_embed = jax.jit(embed)
        self.host_embed_bwd = jax.jit(embed_bwd_into, donate_argnums=(3,))
        self.norm_and_scale = jax.jit(norm_and_scale)
        # (stream.Counters) every call on the dispatching thread; not the user's aux_loss nor the
        # helpers traced inside the calls
        self._count = (lambda fn: fn) if counters is None else counters.counted
        for name, fn in list(vars(self).items()):
            if callable(fn) and not name.startswith("_") and name != "aux_loss":
                setattr(self, name, self._count(fn))

    def head_output(self, output):
        """jit of `output(last, x, targets)` over the stacked micro-batches (its results stacked)
        with the last stage merged from its part's leaves (`output` may read what `last` reads),
        compiled once per `output` and shape."""
        if output not in self._outputs:
            merge, each = self._merge_stages, self._each
            self._outputs[output] = self._count(jax.jit(lambda w, xs, ts: each(
                lambda _, xt: (None, output(merge("last", w)[1], *xt)), None, (xs, ts))[1]))
        return self._outputs[output]
