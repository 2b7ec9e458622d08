"""Forward-only evaluation: the loss of M micro-batches at the current weights.

    embed     fetch the first stage's weights; x_0[m] = first(inputs[m])
    forward   for layer i (weights prefetched, at most prefetch + 1 resident, as in a step):
                x_{i+1}[m] = block_i(x_i[m]); x_i[m] is freed once layer i is done
    loss      fetch the last stage's weights; loss_sum[m], weight[m] = last(x_L[m])
              (`outputs`: any output(last, x_L[m], targets[m]) instead, e.g. per-sequence
              log-probabilities of a frozen model)

The loss is the last stage's alone: a block's auxiliary statistics (a mixture of experts'
load balancing) are dropped, so a MoE model's evaluation loss is its language-model loss.
No gradient, no saved activations, no optimizer state: the params and optax state are only read.
Each unit is fetched once its pending host update (of the step before) has finished, so the loss is
that of the weights after every step so far. It reuses the step's jitted embed and block forward
(and `head_loss`, compiled at the first evaluation), so nothing compiles after the first.
"""

import jax

from megatrain_jax.engine.step import StepParts
from megatrain_jax.engine.stream import LayerStream, delete


def _forward(sp: StepParts, inputs, contexts) -> list:
    """x_L[m] for every micro-batch: the embedding and every block, streamed, forward only."""
    f = sp.functions

    # ---- embed
    xs = sp.first.forward(sp, inputs)

    # ---- forward: each layer's input is freed once its output is computed
    stream = LayerStream(range(sp.num_layers), lambda i: sp.fetch_unit(1 + i), sp.prefetch,
                         on_retire=sp.read())
    for i, w in stream:
        layer = (w, sp.constants[i])
        ys = [f.block_fwd(layer, x, c)[0] for x, c in zip(xs, contexts)]  # aux: not evaluated
        kept = {id(y) for y in ys}  # a jitted identity may hand its input back
        stream.done(ys, (sp.fetched(w), [x for x in xs if id(x) not in kept]))
        xs = ys
    return xs


def run(sp: StepParts, inputs, targets, contexts) -> dict:
    """{"loss_sum", "weight", "loss"} (and "stats" when the last stage returns them, summed)
    over M micro-batches already on the device; scalars still being computed.
    loss = sum(loss_sum) / sum(weight), as a training step's loss."""
    f = sp.functions
    xs = _forward(sp, inputs, contexts)

    # ---- loss
    w = sp.fetch_stage("last")
    out = [f.head_loss(w, x, t) for x, t in zip(xs, targets)]
    delete((sp.fetched(w), xs))
    loss_sum = f.total([s for s, _, _ in out])
    weight = f.total([n for _, n, _ in out])
    loss = loss_sum / jax.numpy.where(weight > 0, weight, 1.0)
    result = {"loss_sum": loss_sum, "weight": weight, "loss": loss}
    if out[0][2] is not None:
        result["stats"] = f.tree_total([s for _, _, s in out])
    return sp.placement.local(result)


def outputs(sp: StepParts, inputs, targets, contexts, output) -> list:
    """[output(last, x_L[m], targets[m]) for every micro-batch m]: the streamed forward, then any
    function of the last stage (e.g. per-sequence log-probabilities) instead of its loss."""
    xs = _forward(sp, inputs, contexts)
    w = sp.fetch_stage("last")
    fn = sp.functions.head_output(output)
    out = [fn(w, x, t) for x, t in zip(xs, targets)]
    delete((sp.fetched(w), xs))
    return out
